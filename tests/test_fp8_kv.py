"""The fp8 KV cache (`kv_cache_dtype="fp8"`, E4M3 codes with one fp32 scale per token and kv head, see
deltaserve/ops/attention.py): the fused C++ step runs it and agrees with the Python model running it, and
on the demo its logits and greedy tokens stay close to those of the fp32 cache."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.assets import demo_checkpoint_path
from deltaserve.cache.tensors import allocate_cache
from deltaserve.engine.config import EngineConfig, EngineConfigError
from deltaserve.executor.fused_cpu.stack import FusedMTP, FusedTrunk, supported
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from deltaserve.ops.attention import FP8
from deltaserve.ops.fused_ext import load_extension
from tests.checkpoints import RATIOS_27B, TINY, random_hf_model, save_causal_lm_layout

BLOCK = 16
# Demo logits (fp32 weights; logits up to 16, standard deviation 2.4) with an fp8 cache against an fp32
# cache, over the 300 positions of the test below: measured largest difference 0.29, mean 0.011, the top
# token the same at every position (a bf16 cache: about 0.02 largest; benchmarks/bench_kv_dtype.py).
DEMO_LOGITS_MAX_DIFF = 0.6
DEMO_LOGITS_MEAN_DIFF = 0.03
DEMO_TOP1_AGREEMENT = 0.98


@pytest.fixture(scope="module", params=["tiny", "27b-ratios"])
def model(request, tmp_path_factory):
    shape, seed = (TINY, 0) if request.param == "tiny" else (RATIOS_27B, 1)
    path = save_causal_lm_layout(random_hf_model(shape, seed=seed), tmp_path_factory.mktemp(request.param))
    return load_model(path, dtype="float32")


@pytest.fixture(scope="module", params=["native", "portable"])
def ext(request):
    return load_extension(portable=request.param == "portable")


def context(cache, lens: list[tuple[int, int]]) -> ForwardContext:
    """(query_len, context_len) per sequence b, which owns blocks 10b.. and slot b."""
    tables = [list(range(10 * b, 10 * b + 10)) for b in range(len(lens))]
    return ForwardContext.paged(cache, [q for q, _ in lens], [c for _, c in lens], tables, list(range(len(lens))))


@torch.inference_mode()
@pytest.mark.parametrize("prompt_attention", ["loop", "torch-kernel"])
def test_fused_step_with_fp8_kv_matches_the_python_model(model, ext, prompt_attention: str) -> None:
    """Both write the same codes and scales (a K value computed in another fp32 order can round to the
    neighbouring code: rare, one step) and attend alike over them."""
    ref_cache = allocate_cache(model.config, num_blocks=64, block_size=BLOCK, num_slots=6, dtype=FP8)
    fused_cache = allocate_cache(model.config, num_blocks=64, block_size=BLOCK, num_slots=6, dtype=FP8)
    assert supported(model, fused_cache) is None
    fused = FusedTrunk(model, fused_cache, ext)
    if prompt_attention == "torch-kernel":
        fused.set_loop_kv_bytes(0)
    g = torch.Generator().manual_seed(3)
    steps = [[(20, 0), (37, 0), (5, 0)], [(18, 20), (3, 37)], [(1, 38), (1, 40), (3, 5), (2, 0)], [(1, 39), (1, 8)]]
    for lens in steps:
        ids = torch.randint(0, model.config.vocab_size, (sum(q for q, _ in lens),), generator=g)
        expected = model(ids, context(ref_cache, lens))
        got = fused(ids, context(fused_cache, lens))
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    for layer, (k, v) in ref_cache.kv.items():
        for ref, out in ((k, fused_cache.kv[layer][0]), (v, fused_cache.kv[layer][1])):
            assert (ref.view(torch.uint8) != out.view(torch.uint8)).float().mean() < 0.01
            # where they differ, by one code: E4M3 neighbours are 1/8 of their binade apart (2^-9 subnormal)
            torch.testing.assert_close(out.float(), ref.float(), atol=2**-9, rtol=0.125)
        for ref, out in zip(ref_cache.kv_scales[layer], fused_cache.kv_scales[layer]):
            torch.testing.assert_close(out, ref, atol=0, rtol=1e-5)


@torch.inference_mode()
def test_demo_logits_with_fp8_kv_are_close_to_fp32_kv() -> None:
    """The fused step over the demo, a 300-token text in prompt chunks of 64 (chunked prefill reading the
    cached chunks): every position's logits with an fp8 cache against those with an fp32 cache."""
    model = load_model(demo_checkpoint_path(), "float32")
    ids = torch.tensor([(37 * i * i + 11 * i) % 8000 + 100 for i in range(300)])
    logits = {}
    for dtype in (torch.float32, FP8):
        cache = allocate_cache(model.config, num_blocks=20, block_size=BLOCK, num_slots=1, dtype=dtype)
        fused = FusedTrunk(model, cache)
        hidden = [fused(ids[s : s + 64], ForwardContext.paged(cache, [len(ids[s : s + 64])], [s], [list(range(20))],
                                                              [0])) for s in range(0, len(ids), 64)]
        logits[dtype] = fused.logits(torch.cat(hidden))
    diff = (logits[FP8] - logits[torch.float32]).abs()
    agree = (logits[FP8].argmax(-1) == logits[torch.float32].argmax(-1)).float().mean()
    measured = (diff.max().item(), diff.mean().item(), agree.item())
    assert diff.max() < DEMO_LOGITS_MAX_DIFF and diff.mean() < DEMO_LOGITS_MEAN_DIFF, measured
    assert agree >= DEMO_TOP1_AGREEMENT, measured
    assert diff.max() > 0  # the cache did hold fp8


def test_demo_greedy_tokens_with_fp8_kv_run_fused_and_match_fp32_kv(caplog) -> None:
    """Greedy continuations of a few prompts on the demo (prompts in chunks of 16: chunked prefill): the same
    tokens with the fp8 cache as with the fp32 one, the fused step running them (make_executor chose it),
    and the same again from the eager Python model with the fp8 cache and from MTP speculation over it."""
    prompts = ["Once upon a time, a little fox", "Q: What is 12 plus 7?\nA:", "The king said unto",
               "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    tokens = {}
    reference = None  # the fp32-cache engine
    for kv, eager, spec in (("auto", False, None), ("fp8", False, None), ("fp8", True, None), ("fp8", False, mtp)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="deltaserve.executor.factory"):
            llm = LLM(kv_cache_dtype=kv, enforce_eager=eager, speculative_config=spec, max_model_len=512,
                      max_num_batched_tokens=16)
        executor = llm.engine.executor
        assert executor.name == ("torch" if eager else "fused-cpu")
        if not eager:
            assert "executor: fused-cpu" in caplog.text
        if spec is not None:
            assert isinstance(executor._mtp, FusedMTP)  # the draft passes over the fp8 MTP layer cache too
        if kv == "fp8":
            assert all(k.dtype == FP8 for pair in llm.engine.cache_tensors.kv.values() for k in pair)
        tokens[kv, eager, spec is not None] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        reference = reference or llm
    for prompt, fp32, fp8 in zip(prompts, tokens["auto", False, False], tokens["fp8", False, False], strict=True):
        same_up_to_a_near_tie(reference, prompt, fp32, fp8)
    assert tokens["fp8", True, False] == tokens["fp8", False, False]
    assert tokens["fp8", False, True] == tokens["fp8", False, False]


def same_up_to_a_near_tie(llm: LLM, prompt: str | list[int], want: list[int], got: list[int],
                          margin: float = DEMO_LOGITS_MAX_DIFF) -> None:
    """Greedy tokens `got` are llm's `want`, unless they part where llm scores got's token within `margin` of
    its best (the other computation's logits error; by default the fp8 cache's, DEMO_LOGITS_MAX_DIFF): there
    the other may pick it. (Not only the second best: the int8 demo has a three-way tie, 0.012 and 0.019 from
    the best, where the fused step picked the third on an AMD EPYC.)"""
    if got == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
    probe = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    ids = (llm.get_tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)) + want[:at]
    [out] = llm.generate([{"prompt_token_ids": ids}], probe, use_tqdm=False)
    top = out.outputs[0].logprobs[0]  # token id -> logprob, the 20 best
    assert out.outputs[0].token_ids == [want[at]]
    assert got[at] in top and top[want[at]] - top[got[at]] < margin, (at, top)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "float8_e4m3fn"])
def test_fp8_names_are_accepted(name: str) -> None:
    EngineConfig(kv_cache_dtype=name)


def test_fp8_e5m2_is_refused_by_name() -> None:
    with pytest.raises(EngineConfigError, match=r"kv_cache_dtype 'fp8_e5m2' is not supported .*use fp8 or fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
