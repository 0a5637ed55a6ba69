"""Sparse-MoE models (Qwen3.5-MoE, Qwen3-Next) against transformers on small random checkpoints (fp32), in
both expert layouts: logits of prompts stateless and through the paged cache, chunked and decoding, and
greedy continuations; routing ties, an expert no token picks, mlp_only_layers and decoder_sparse_step."""

from __future__ import annotations

import pytest
import torch

from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from deltaserve.model.moe import SparseMoeBlock
from tests.checkpoints import (
    MOE,
    RATIOS_27B,
    TINY,
    random_hf_moe_model,
    random_mtp_tensors,
    save_causal_lm_layout,
    save_official_layout,
)
from tests.test_model_core import PagedSequence, assert_prompt_matches, hf_logits, new_cache, run_chunks
from tests.test_mtp import reference_mtp_logits

# fp32 rounding: the chunked GDN and the experts' sums run in other orders than transformers'; on an AMX Xeon
# (other torch kernels) one row of the 27B-ratios case reached 2.1e-4 of logits up to 2.8
TOL = 3e-4

CASES = {
    # family, shape, config fields, layout, fused experts
    "qwen3_5_moe-official-per-expert": ("qwen3_5_moe", TINY, {}, "official", False),
    "qwen3_5_moe-27b-ratios-fused": ("qwen3_5_moe", RATIOS_27B, {}, "causal", True),
    "qwen3_next-mlp-only-layer": ("qwen3_next", TINY, dict(mlp_only_layers=[1]), "causal", False),
    "qwen3_next-27b-ratios-fused-sparse-step-2": (
        "qwen3_next", RATIOS_27B, dict(decoder_sparse_step=2, norm_topk_prob=False), "causal", True),
}


def save(hf, path, layout: str, fused: bool, mtp=None):
    saver = save_official_layout if layout == "official" else save_causal_lm_layout
    return saver(hf, path, mtp, fused_experts=fused)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    family, shape, fields, layout, fused = CASES[request.param]
    hf = random_hf_moe_model(family, shape, seed=len(request.param), **fields)
    path = save(hf, tmp_path_factory.mktemp(request.param), layout, fused)
    return hf, load_model(path, dtype="float32")


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_layers_are_sparse_where_the_config_says(pair):
    hf, ours = pair
    for h, o in zip(hf.model.layers, ours.model.layers, strict=True):
        assert isinstance(o.mlp, SparseMoeBlock) == hasattr(h.mlp, "experts")


def test_prompt_matches_transformers_stateless_and_paged(pair):
    hf, ours = pair
    assert_prompt_matches(hf, ours, _ids(40, 0, hf.config.vocab_size))


def test_chunks_and_decode_steps_match_transformers(pair):
    hf, ours = pair
    ids = _ids(100, 1, hf.config.vocab_size)
    ref = hf_logits(hf, ids)
    got = run_chunks(ours, new_cache(ours), PagedSequence(0, 2), ids, [7, 1, 64, 8] + [1] * 20)
    assert (got - ref).abs().max() < TOL


def test_three_sequences_in_one_flat_forward(pair):
    """A fresh prompt, a continued chunk and a decode token in ONE forward route and match each alone."""
    hf, ours = pair
    a, b, c = (_ids(n, 10 + n, hf.config.vocab_size) for n in (23, 50, 12))
    refs = [hf_logits(hf, x) for x in (a, b, c)]
    cache = new_cache(ours)
    seqs = [PagedSequence(0, 0), PagedSequence(32, 1), PagedSequence(64, 2)]
    run_chunks(ours, cache, seqs[1], b, [30])
    run_chunks(ours, cache, seqs[2], c, [11])
    ctx = ForwardContext.paged(cache, [23, 20, 1], [0, 30, 11], [s.blocks for s in seqs], [s.slot for s in seqs])
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.cat([a, b[30:], c[11:]]), ctx))
    assert (logits[:23] - refs[0]).abs().max() < TOL
    assert (logits[23:43] - refs[1][30:]).abs().max() < TOL
    assert (logits[43:] - refs[2][11:]).abs().max() < TOL


def greedy(ours, prompt: torch.Tensor, n: int) -> list[int]:
    cache, seq = new_cache(ours), PagedSequence(0, 1)
    logits = run_chunks(ours, cache, seq, prompt, [len(prompt)])[-1]
    got = []
    for _ in range(n):
        got.append(int(logits.argmax()))
        logits = run_chunks(ours, cache, seq, torch.tensor([got[-1]]), [1])[-1]
    return got


def hf_greedy(hf, prompt: torch.Tensor, n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return hf.generate(prompt[None], max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()


def test_greedy_continuation_equals_transformers_generate(pair):
    hf, ours = pair
    prompt = _ids(9, 5, hf.config.vocab_size)
    assert greedy(ours, prompt, 32) == hf_greedy(hf, prompt, 32)


def tied_router_models(family: str, tmp_path):
    """transformers' model and ours, whose layer 0 router is zero: all experts tie for every token, so which
    k win is torch.topk's choice (not the lowest ids; checked). The other layers' routers repeat rows in
    pairs: exact ties between two experts decide membership whenever the pair straddles the k-th place."""
    hf = random_hf_moe_model(family, TINY, seed=7)
    with torch.no_grad():
        routers = [layer.mlp.gate.weight for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
        routers[0].zero_()
        for w in routers[1:]:
            w[1::2] = w[0::2]
    ours = load_model(save(hf, tmp_path, "causal", fused=False), dtype="float32")
    with torch.no_grad():
        picked = ours.model.layers[0].mlp.route(torch.randn(5, TINY["hidden_size"]))[0]
    assert sorted(picked[0].tolist()) != list(range(MOE["num_experts_per_tok"]))  # ties are not lowest-first
    return hf, ours


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_routing_ties_break_as_transformers(family, tmp_path):
    hf, ours = tied_router_models(family, tmp_path)
    ids = _ids(30, 3, TINY["vocab_size"])
    assert_prompt_matches(hf, ours, ids)
    ref = hf_logits(hf, ids)
    assert (run_chunks(ours, new_cache(ours), PagedSequence(0, 0), ids, [11, 19]) - ref).abs().max() < TOL
    assert greedy(ours, ids[:6], 16) == hf_greedy(hf, ids[:6], 16)


def test_an_expert_no_token_picks_is_never_read(tmp_path):
    """Per MoE layer one expert none of the prompt's tokens chooses gets NaN weights: transformers skips it,
    and so must we (a dense all-experts product masked by zero weights would give NaN)."""
    hf = random_hf_moe_model("qwen3_5_moe", TINY, seed=8)
    ids = _ids(3, 4, TINY["vocab_size"])  # 3 tokens x top-2 of 8 experts: at least 2 left unpicked per layer
    with torch.no_grad():
        router_logits = hf(ids[None], output_router_logits=True).router_logits
        for layer, logits in zip(hf.model.layers, router_logits, strict=True):
            chosen = set(logits.topk(MOE["num_experts_per_tok"], dim=-1).indices.flatten().tolist())
            unused = sorted(set(range(MOE["num_experts"])) - chosen)
            assert unused, "every expert was picked; use a shorter prompt"
            layer.mlp.experts.gate_up_proj[unused[0]] = float("nan")
            layer.mlp.experts.down_proj[unused[0]] = float("nan")
    ref = hf_logits(hf, ids)
    assert torch.isfinite(ref).all()
    ours = load_model(save(hf, tmp_path, "official", fused=True), dtype="float32")
    assert_prompt_matches(hf, ours, ids)
    assert (run_chunks(ours, new_cache(ours), PagedSequence(0, 0), ids, [2, 1]) - ref).abs().max() < TOL


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_equals_transformers_block(family, dtype):
    """The block alone against transformers' SparseMoeBlock: bitwise equal in bf16 (same matmuls per expert,
    the same dtype at every step, experts added to each token in the same order), to rounding in fp32."""
    from deltaserve.config import ModelConfig
    from tests.checkpoints import hf_moe_config

    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block
    hf_cfg = hf_moe_config(family, TINY)
    cfg = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": None})
    torch.manual_seed(0)
    theirs = Block(hf_cfg)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = SparseMoeBlock(cfg)
    ours.load_state_dict(theirs.state_dict())
    theirs.to(dtype)
    ours.to(dtype)
    x = torch.randn(1, 37, TINY["hidden_size"]).to(dtype)
    with torch.no_grad():
        want, got = theirs(x)[0], ours(x[0])
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family, layout", [("qwen3_5_moe", "official"), ("qwen3_next", "causal")])
def test_mtp_head_of_a_moe_checkpoint_matches_formula_reference(family, layout, tmp_path):
    """The MoE releases' MTP layer is sparse too (mtp.layers.0.mlp has a router and experts)."""
    hf = random_hf_moe_model(family, TINY, seed=9)
    mtp = random_mtp_tensors(TINY, seed=2, moe=MOE)
    ours = load_model(save(hf, tmp_path, layout, fused=False, mtp=mtp), dtype="float32")
    assert isinstance(ours.mtp.layers[0].mlp, SparseMoeBlock)
    ids = _ids(30, 6, TINY["vocab_size"])
    ref = reference_mtp_logits(hf, mtp, ids)
    with torch.no_grad():
        h = ours(ids, ForwardContext.stateless([30]))
        got = ours.compute_logits(ours.mtp_hidden(ids[1:], h[:-1], ForwardContext.stateless([29])))
    assert (got - ref).abs().max() < TOL
