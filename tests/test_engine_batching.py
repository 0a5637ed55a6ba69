"""Continuous batching with chunked prefill: a mixed batch gives token-for-token the outputs of each prompt
run alone and of transformers' greedy generate; seeded sampling does not depend on the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.scheduler import DECODE, PREFILL
from tests.checkpoints import RATIOS_27B, random_hf_model, save_official_layout

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    hf = random_hf_model(RATIOS_27B, seed=3)
    return hf, save_official_layout(hf, tmp_path_factory.mktemp("ckpt"))


def _prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Lengths 1..130 cross the GDN chunk (64) and block (16) boundaries; ids avoid the EOS id 1.
    lengths = [1, 2, 5, 16, 17, 63, 64, 65, 130] + torch.randint(3, 120, (n - 9,), generator=g).tolist()
    return [torch.randint(2, RATIOS_27B["vocab_size"], (n_,), generator=g).tolist() for n_ in lengths]


def test_mixed_batch_matches_alone_and_transformers(checkpoint: tuple[object, Path]) -> None:
    hf, path = checkpoint
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    # A budget of 24 tokens forces long prompts into several chunks, sharing steps with decodes.
    llm = LLM(model=str(path), max_num_batched_tokens=24, max_num_seqs=16, max_model_len=256)
    kinds: list[set[str]] = []
    llm.engine.step_listeners.append(lambda s: kinds.append({k for _, _, k in s.summary()}))
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(k == {PREFILL, DECODE} for k in kinds), "no step mixed prefill chunks with decode tokens"
    assert max(len(p) for p in prompts) > 24  # so some prompt really was chunked

    alone_llm = LLM(model=str(path), max_model_len=256)
    for prompt, out in zip(prompts, batched, strict=True):
        alone = alone_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS)
        ref_ids = ref[0, len(prompt) :].tolist()
        got = out.outputs[0].token_ids
        assert got == alone.outputs[0].token_ids, f"prompt of {len(prompt)} tokens: batch differs from alone"
        assert got == ref_ids, f"prompt of {len(prompt)} tokens: {got} != transformers {ref_ids}"
        assert out.finished and out.outputs[0].finish_reason in ("stop", "length")
        assert out.prompt_token_ids == prompt
    assert llm.engine.cache.usage().used_blocks == 0


def test_seeded_sampling_same_alone_and_in_batch(checkpoint: tuple[object, Path]) -> None:
    _, path = checkpoint
    prompts = _prompts(12, seed=1)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=str(path), max_num_batched_tokens=32, max_model_len=256)
    alone = llm.generate({"prompt_token_ids": prompts[5]}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    params = [noise] * len(prompts)
    params[5] = seeded
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert batch[5].outputs[0].token_ids == alone
    assert len(alone) == 12


def test_n_fans_out_with_distinct_seeded_children(checkpoint: tuple[object, Path]) -> None:
    _, path = checkpoint
    llm = LLM(model=str(path), max_model_len=256)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    seqs = [tuple(o.token_ids) for o in out.outputs]
    assert len(set(seqs)) > 1, "children with offset seeds all drew the same tokens"
    again = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == seqs
    for o in out.outputs:
        assert o.logprobs is not None and len(o.logprobs) == 10
        assert all(tok in lp for tok, lp in zip(o.token_ids, o.logprobs, strict=True))
        assert o.cumulative_logprob == pytest.approx(
            sum(lp[t] for t, lp in zip(o.token_ids, o.logprobs, strict=True))
        )
