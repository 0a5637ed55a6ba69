"""Sparse-MoE checkpoints through the engine: the default engine runs the fused C++ step (its MoE block) and
matches transformers' greedy generate, as does enforce_eager (the torch executor); batching with chunked
prefill, and preemption, give each request its tokens alone; MTP speculation on the MoE MTP head, drafted
by the fused MTP head, gives plain greedy's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.executor.fused_cpu.stack import FusedMTP
from tests.checkpoints import (
    MOE,
    RATIOS_27B,
    random_hf_moe_model,
    random_mtp_tensors,
    save_causal_lm_layout,
    save_official_layout,
)

MAX_TOKENS = 12
SHAPE = RATIOS_27B


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A random MoE checkpoint whose MTP head often agrees with the trunk (tests/test_spec_decode.py's
    recipe: large embeddings and damped mixer / MLP outputs make the trunk close to a bigram model, which
    the MTP head, passing the embedding through fc, predicts), so drafts are both accepted and rejected."""
    family = request.param
    hf = random_hf_moe_model(family, SHAPE, seed=11, **({"mlp_only_layers": [2]} if family == "qwen3_next" else {}))
    damp = 0.3
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(12.0)
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(damp)
    mtp = random_mtp_tensors(SHAPE, seed=12, moe=MOE)
    H = SHAPE["hidden_size"]
    mtp["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    mtp["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
    mtp["mtp.norm.weight"] = hf.model.norm.weight.detach().clone()
    for name in mtp:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            mtp[name] = mtp[name] * damp
    saver = save_official_layout if family == "qwen3_5_moe" else save_causal_lm_layout
    path = saver(hf, tmp_path_factory.mktemp(family), mtp, fused_experts=family == "qwen3_5_moe")
    if family == "qwen3_next":  # transformers' Qwen3NextConfig has no MTP field: the mtp.* tensors say it
        config = json.loads((path / "config.json").read_text())
        del config["mtp_num_hidden_layers"]
        (path / "config.json").write_text(json.dumps(config))
    return hf, path


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 17, 65, 90] + torch.randint(3, 60, (n - 5,), generator=g).tolist()
    return [torch.randint(2, SHAPE["vocab_size"], (k,), generator=g).tolist() for k in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_default_fused_and_eager_torch_engines_match_transformers(checkpoint) -> None:
    hf, path = checkpoint
    prompts = _prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    hf.generation_config.eos_token_id = None
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    for eager in (False, True):
        llm = LLM(model=str(path), enforce_eager=eager, max_model_len=256)
        assert llm.engine.executor.name == ("torch" if eager else "fused-cpu")
        got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        assert got == want, f"enforce_eager={eager}"


def test_chunked_batch_and_preemption_give_each_request_alone(checkpoint) -> None:
    _, path = checkpoint
    prompts = [{"prompt_token_ids": p} for p in _prompts(10, seed=1)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 7 + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True) for s in range(3)
    ]
    alone_llm = LLM(model=str(path), max_model_len=128)
    alone = [_tokens(alone_llm.generate(p, q, use_tqdm=False))[0] for p, q in zip(prompts, params, strict=True)]
    # 24 tokens a step: long prompts are chunked and share steps with other requests' decodes.
    batched = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=24, max_num_seqs=10)
    assert _tokens(batched.generate(prompts, params, use_tqdm=False)) == alone
    # 10 blocks of 16 tokens: room for one long sequence, far too few for ten.
    tight = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=48, max_num_seqs=10, num_kv_blocks=10)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == alone
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.cache.usage().used_blocks == 0


def test_mtp_speculation_on_the_moe_head_is_plain_greedy(checkpoint) -> None:
    _, path = checkpoint
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, seed=2)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=32)
    spec = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=32,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    assert spec.engine.executor.name == "fused-cpu"
    assert isinstance(spec.engine.executor._mtp, FusedMTP)  # the sparse MTP layer drafts in C++ too
    assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == _tokens(
        plain.generate(prompts, params, use_tqdm=False))
    stats = spec.engine.stats().spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both acceptance and rejection"
    assert spec.engine.cache.usage().used_blocks == 0
