"""The fused C++ step (deltaserve/executor/fused_cpu, deltaserve/ops/csrc) against the Python model it replaces:
the same hidden states, logits, cache writes and per-position verify states, on random checkpoints whose
weights are fp32 (some with values that are bf16 numbers), and on models whose projections are stored in
bfloat16, fp8, int8 or int4 (against the same model with the dequantized weights)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.executor import TorchExecutor
from deltaserve.executor.fused_cpu.stack import FusedMTP, FusedTrunk, supported
from deltaserve.model.context import ForwardContext
from deltaserve.model.linear import Linear, StoredWeights, store, tie
from deltaserve.model.loader import load_model
from deltaserve.ops.formats import WeightFormat, dequantize, quantize
from deltaserve.ops.fused_ext import load_extension
from tests.checkpoints import (
    RATIOS_27B,
    TINY,
    random_hf_model,
    random_mtp_tensors,
    save_causal_lm_layout,
    save_official_layout,
    tied_odd_pattern_model,
)

BLOCK = 16


@pytest.fixture(scope="module", params=["tiny-fp32", "27b-ratios-bf16-values", "tied-odd-pattern", "wide-gdn-heads"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny-fp32":
        hf = random_hf_model(TINY, seed=0)
    elif request.param == "wide-gdn-heads":  # value heads of 80 = 64 + 16: the register-tiled state reads
        hf = random_hf_model(dict(TINY, linear_key_head_dim=32, linear_value_head_dim=80), seed=5)
    elif request.param == "27b-ratios-bf16-values":
        hf = random_hf_model(RATIOS_27B, seed=1)
        with torch.no_grad():  # a bf16 checkpoint computed in fp32: every weight is a bf16 number
            for p in hf.parameters():
                p.copy_(p.bfloat16().float())
    else:
        hf = tied_odd_pattern_model(seed=2)
    save_causal_lm_layout(hf, path)
    return load_model(path, dtype="float32")


@pytest.fixture(scope="module", params=["native", "portable"])
def ext(request):
    """Both builds of the C++ step: for this CPU (-march=native), and portable (-march=x86-64-v2, where the
    sources' non-AVX-512 branches are compiled)."""
    return load_extension(portable=request.param == "portable")


def test_the_portable_build_runs_the_portable_branches(model) -> None:
    """The portable build has no AVX-512, so no bf16 screen (AVX512-BF16 only) even on a CPU that has it;
    the native build screens an lm_head stored in bf16 on such a CPU."""
    cache = allocate_cache(model.config, num_blocks=4, block_size=BLOCK, num_slots=1)
    assert not FusedTrunk(model, cache, load_extension(portable=True)).greedy_screen
    bf16_lm_head = model.lm_head.weight.dtype == torch.bfloat16
    cpu_has_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    assert FusedTrunk(model, cache).greedy_screen == (bf16_lm_head and cpu_has_bf16)


def junk_cache(model, seed: int):
    """A cache whose state slots hold garbage, as slots freed by earlier requests do."""
    cache = allocate_cache(model.config, num_blocks=64, block_size=BLOCK, num_slots=6)
    g = torch.Generator().manual_seed(seed)
    for t in [*cache.conv.values(), *cache.ssm.values()]:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def context(cache, lens: list[tuple[int, int]], verify: list[bool] | None = None) -> ForwardContext:
    """(query_len, context_len) per sequence b, which owns blocks 10b.. and slot b."""
    tables = [list(range(10 * b, 10 * b + 10)) for b in range(len(lens))]
    return ForwardContext.paged(
        cache, [q for q, _ in lens], [c for _, c in lens], tables, list(range(len(lens))), verify
    )


def assert_caches_equal(a, b, tol: float = 1e-4) -> None:
    for layer in a.conv:
        torch.testing.assert_close(b.conv[layer], a.conv[layer], atol=tol, rtol=tol)
        torch.testing.assert_close(b.ssm[layer], a.ssm[layer], atol=tol, rtol=tol)
    for layer, (k, v) in a.kv.items():
        torch.testing.assert_close(b.kv[layer][0], k, atol=tol, rtol=tol)
        torch.testing.assert_close(b.kv[layer][1], v, atol=tol, rtol=tol)


@torch.inference_mode()
@pytest.mark.parametrize("prompt_attention", ["loop", "torch-kernel"])
def test_fused_steps_match_the_python_model(model, ext, prompt_attention: str) -> None:
    assert_steps_match(model, model, ext, prompt_attention)


# Unquantized in every format, as the loader leaves them (Qwen's FP8 releases too): the GDN b and a
# projections and the router.
UNQUANTIZED = ("in_proj_b", "in_proj_a", "mlp.gate")


def stored_in(model, fmt: WeightFormat):
    """(reference, stored): the model with each projection's weight replaced by its fmt values dequantized
    (fp32), and a copy whose projections hold the stored data, scales and format themselves (the contract of
    deltaserve/model/linear.py: .weight, .weight_scale, .fmt). A tied embedding is the stored lm_head's data."""
    tied = model.model.embed_tokens.weight is model.lm_head.weight
    stored = copy.deepcopy(model)
    for (name, ref), (_, mod) in zip(model.named_modules(), stored.named_modules()):
        if not isinstance(ref, Linear) or name.endswith(UNQUANTIZED) and fmt.quantized:
            continue
        k = ref.weight.shape[1]
        data, scale = quantize(ref.weight.detach(), fmt)
        ref.weight.data.copy_(dequantize(data, scale, fmt, k))
        store(mod, fmt)
        mod.weight.data.copy_(data)
        if scale is not None:
            mod.weight_scale.data.copy_(scale)
    if tied:
        tie(stored.model.embed_tokens, stored.lm_head)
    return model, stored


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", "int8", "int4"])
def test_fused_steps_of_stored_formats_match_the_python_model(tmp_path, ext, fmt: str) -> None:
    """The fused step reads the stored weights (formats mixed within a fused projection: int8 q|k|v|z with
    float32 b|a) and matches the Python model computing with their dequantized values; tied (bf16, int8), the
    embedding rows are read from the lm_head's stored data and scales."""
    tie = fmt in ("bfloat16", "int8")
    hf = random_hf_model(dict(TINY, hidden_size=40), seed=6, tie=tie)  # K = 40: a partial last group of 32
    ref, stored = stored_in(load_model(save_causal_lm_layout(hf, tmp_path), dtype="float32"), WeightFormat.of(fmt))
    assert stored.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == WeightFormat.of(fmt).data_dtype
    assert (ref.model.embed_tokens.weight is ref.lm_head.weight) == tie
    with torch.inference_mode():
        assert_steps_match(ref, stored, ext, "loop")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_steps_with_int8_activations_match_the_python_model(tmp_path, ext, fmt: str) -> None:
    """activation_quantization "int8" on int8 / int4 weights (the GDN gates b|a stay float32 and read x as it
    is): the fused step's integer kernel against the Python model's modules computing the same scheme
    (deltaserve/ops/activation_quant.py). Given the same input rows, every projection's kernel output is the
    module's to fp32 rounding; over whole steps (prompt chunks, decodes, verify segments) the two executors'
    inputs differ by fp32 rounding, which now and then rounds an input to the neighbouring int8 value (one
    step, amax / 127, of one input: ~1e-3 here, carried on by the GDN state), hence the steps' looser bound
    (the native int4 case's worst element is 0.046 off since its 62-row prompt step runs AMX tiles, whose sums
    round in another order than the packed kernel's: other inputs flip)."""
    hf = random_hf_model(dict(TINY, hidden_size=40), seed=6, tie=fmt == "int8")
    _, stored = stored_in(load_model(save_causal_lm_layout(hf, tmp_path), dtype="float32"), WeightFormat.of(fmt))
    for module in stored.modules():
        if isinstance(module, StoredWeights):
            module.activation_quantization = "int8"
    checked = []

    def same_as_the_kernel(module, inputs, output) -> None:
        x = inputs[0].float().reshape(-1, module.in_features).contiguous()
        part = (module.weight, module.weight_scale, module.fmt.name, module.fmt.group)
        torch.testing.assert_close(ext.linear(x, [part], "int8"), output.reshape(x.shape[0], -1),
                                   atol=1e-5, rtol=1e-5)
        checked.append(module)

    hooks = [m.register_forward_hook(same_as_the_kernel) for m in stored.modules()
             if isinstance(m, Linear) and m.fmt.name == fmt]
    with torch.inference_mode():
        assert_steps_match(stored, stored, ext, "loop", tol=6e-2)
    for hook in hooks:
        hook.remove()
    assert len(set(checked)) == len(hooks) > 10


def assert_steps_match(ref_model, model, ext, prompt_attention: str, tol: float = 1e-4) -> None:
    """The fused trunk of `model` over prompt, decode and verify steps against ref_model's forward (within
    atol = rtol = tol)."""
    ref_cache, fused_cache = junk_cache(ref_model, 0), junk_cache(model, 0)
    fused = FusedTrunk(model, fused_cache, ext)
    if prompt_attention == "torch-kernel":  # chunks of more than 16 tokens, as when their K/V outgrow the caches
        fused.set_loop_kv_bytes(0)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)

    steps = [
        # prompts over several of the loop's 16-token work items, or through torch's kernel (causal)
        ([(20, 0), (37, 0), (5, 0)], None),
        # a continued long chunk (masked attention over a cached prefix) next to a short one
        ([(18, 20), (3, 37)], None),
        # a decode, a verify segment of 4, a prompt tail of 3, a fresh 2-token prompt, a fresh single token
        ([(1, 38), (4, 40), (3, 5), (2, 0), (1, 0)], [False, True, False, False, False]),
        # decodes and a verify of 3 (the projections' 1-3 row tails)
        ([(1, 39), (3, 41), (1, 8), (1, 2), (1, 1)], [False, True, False, False, False]),
    ]
    for lens, verify in steps:
        T = sum(q for q, _ in lens)
        ids = torch.randint(0, V, (T,), generator=g)
        ref_ctx, fused_ctx = context(ref_cache, lens, verify), context(fused_cache, lens, verify)
        expected = ref_model(ids, ref_ctx)
        got = fused(ids, fused_ctx)
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
        torch.testing.assert_close(fused.logits(got), ref_model.compute_logits(expected), atol=tol, rtol=tol)
        assert torch.equal(fused.greedy_tokens(got), fused.logits(got).argmax(dim=-1))
        assert fused_ctx.spec_states.keys() == ref_ctx.spec_states.keys()
        for layer, (conv, ssm) in ref_ctx.spec_states.items():
            got_conv, got_ssm = fused_ctx.spec_states[layer]
            n = lens[1][0]  # the verify segment's length: compare its real positions
            torch.testing.assert_close(got_conv[:, :n], conv[:, :n], atol=tol, rtol=tol)
            torch.testing.assert_close(got_ssm[:, :n], ssm[:, :n], atol=tol, rtol=tol)
        assert_caches_equal(ref_cache, fused_cache, tol)


@torch.inference_mode()
@pytest.mark.parametrize("wanted", [None, "last and mid rows"])
def test_a_step_of_many_sequences_runs_its_layers_in_blocks(model, ext, wanted) -> None:
    """Past 256 rows a step's GDN and attention layers take its sequences in blocks of about 256 rows
    (stack.cpp over_sequence_blocks): here [0, 1) (200 rows), [1, 3) (151), [3, 4) (300) and [4, 7) with a
    verify segment, a 600-token prompt and the 9-row last block it takes in. The Python model runs the whole
    step at once: each sequence reads and writes its own state slot and KV blocks at its own positions (each
    block's rotary rows), the verify segment's states land in its row, whichever block it is in. With wanted
    rows, the last layer (attention) runs them alone block by block, rows from every block and none in some."""
    lens = [(200, 0), (150, 7), (1, 12), (300, 0), (4, 30), (600, 0), (9, 3)]
    verify = [False, False, False, False, True, False, False]
    width = 40  # blocks of 16 tokens per sequence: room for 640
    caches = []
    for _ in range(2):
        cache = allocate_cache(model.config, num_blocks=width * len(lens), block_size=BLOCK, num_slots=len(lens))
        g = torch.Generator().manual_seed(8)
        for t in [*cache.conv.values(), *cache.ssm.values()]:
            t.copy_(torch.randn(t.shape, generator=g))
        caches.append(cache)
    ref_cache, fused_cache = caches
    tables = [list(range(width * b, width * (b + 1))) for b in range(len(lens))]

    def step_context(cache):
        return ForwardContext.paged(cache, [q for q, _ in lens], [c for _, c in lens], tables,
                                    list(range(len(lens))), verify)

    T = sum(q for q, _ in lens)
    ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(9))
    ref_ctx, fused_ctx = step_context(ref_cache), step_context(fused_cache)
    expected = model(ids, ref_ctx)
    rows = None if wanted is None else torch.tensor([5, 199, 351, 352, 650, 651, 652, 653, 1000, 1263])
    got = FusedTrunk(model, fused_cache, ext)(ids, fused_ctx, rows)
    torch.testing.assert_close(got, expected if rows is None else expected[rows], atol=1e-4, rtol=1e-4)
    assert_caches_equal(ref_cache, fused_cache)
    assert fused_ctx.spec_states.keys() == ref_ctx.spec_states.keys()
    for layer, (conv, ssm) in ref_ctx.spec_states.items():
        got_conv, got_ssm = fused_ctx.spec_states[layer]
        torch.testing.assert_close(got_conv[:, :4], conv[:, :4], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_ssm[:, :4], ssm[:, :4], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_fused_step_hands_back_only_the_rows_asked_for(model, ext) -> None:
    """output_rows: the asked rows' hidden states as the full step computes them, and every token's K/V and
    GDN states cached all the same (the last layer skips only what nothing reads)."""
    full_cache, rows_cache = junk_cache(model, 5), junk_cache(model, 5)
    full, rows_only = FusedTrunk(model, full_cache, ext), FusedTrunk(model, rows_cache, ext)
    g = torch.Generator().manual_seed(6)
    steps = [
        # prompts whose last tokens sample (the runner's rows), one of them over several 16-token work items
        ([(20, 0), (37, 0), (5, 0)], [19, 56, 61]),
        # a continued chunk that samples nothing next to a decode; runs of wanted tokens, not only last ones
        ([(18, 20), (1, 37)], [3, 4, 5, 9, 18]),
        # mid-prompt chunks only: no row at all
        ([(6, 38), (4, 5)], []),
        # decodes and a prompt tail
        ([(1, 44), (1, 37), (3, 9)], [0, 1, 4]),
    ]
    for lens, rows in steps:
        ids = torch.randint(0, model.config.vocab_size, (sum(q for q, _ in lens),), generator=g)
        expected = full(ids, context(full_cache, lens))
        got = rows_only(ids, context(rows_cache, lens), torch.tensor(rows, dtype=torch.long))
        assert got.shape == (len(rows), model.config.hidden_size)
        torch.testing.assert_close(got, expected[rows], atol=1e-5, rtol=1e-5)
        assert_caches_equal(full_cache, rows_cache)
    with pytest.raises(RuntimeError, match="output_rows must ascend"):
        rows_only(ids, context(rows_cache, lens), torch.tensor([1, 0], dtype=torch.long))


@torch.inference_mode()
def test_fused_commit_of_verified_states_matches_the_python_commit(model, ext) -> None:
    ref_cache, fused_cache = junk_cache(model, 1), junk_cache(model, 1)
    fused = FusedTrunk(model, fused_cache, ext)
    lens, verify = [(4, 6), (1, 3), (3, 9)], [True, False, True]
    ids = torch.randint(0, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(4))
    ref_ctx, fused_ctx = context(ref_cache, lens, verify), context(fused_cache, lens, verify)
    model(ids, ref_ctx)
    fused(ids, fused_ctx)
    accepted = [2, 0]  # the first verify segment keeps 3 positions, the second 1
    TorchExecutor(model, ref_cache).commit_verified(ref_ctx, accepted)
    fused.commit_verified(fused_ctx, accepted)
    assert_caches_equal(ref_cache, fused_cache)


def test_fused_logits_for_few_and_many_rows(model, ext) -> None:
    fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=BLOCK, num_slots=1), ext)
    hidden = torch.randn(200, model.config.hidden_size)
    with torch.inference_mode():  # 200 rows: more than one of the packed kernel's row blocks
        for rows in ([3], list(range(8)), list(range(20)), list(range(200))):
            torch.testing.assert_close(
                fused.logits(hidden, rows), model.compute_logits(hidden, rows), atol=1e-5, rtol=1e-5
            )


def test_fused_greedy_tokens_are_the_argmax_of_the_logits(model, ext) -> None:
    fused = FusedTrunk(model, allocate_cache(model.config, num_blocks=4, block_size=BLOCK, num_slots=1), ext)
    hidden = torch.randn(40, model.config.hidden_size)
    hidden[7] = 0.0  # every logit equal: the first index, as torch.argmax
    hidden[9, 3] = float("nan")  # NaN logits count as the largest, as in torch.argmax
    with torch.inference_mode():
        for rows in ([9], [3, 7], list(range(40))):
            expected = model.compute_logits(hidden, rows).argmax(dim=-1)
            assert torch.equal(fused.greedy_tokens(hidden, rows), expected)


def test_only_float32_models_and_caches_are_fused(model, tmp_path) -> None:
    """(and fp8 KV caches: tests/test_fp8_kv.py)"""
    cache = allocate_cache(model.config, num_blocks=4, block_size=BLOCK, num_slots=1, dtype=torch.bfloat16)
    assert supported(model, cache) == "the KV cache is neither float32 nor fp8"
    with pytest.raises(ValueError, match="KV cache is neither float32 nor fp8"):
        FusedTrunk(model, cache)
    cache = allocate_cache(model.config, num_blocks=4, block_size=BLOCK, num_slots=1, dtype=torch.float8_e4m3fn)
    cache.conv = {i: t.bfloat16() for i, t in cache.conv.items()}
    assert supported(model, cache) == "the GDN state cache is not float32"


@pytest.mark.parametrize("bf16_values", [False, True], ids=["fp32", "bf16-values"])
def test_fused_mtp_matches_the_python_head(tmp_path, ext, bf16_values: bool) -> None:
    hf = random_hf_model(RATIOS_27B, seed=4)
    mtp = random_mtp_tensors(RATIOS_27B)
    if bf16_values:
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.bfloat16().float())
        mtp = {k: v.bfloat16().float() for k, v in mtp.items()}
    model = load_model(save_official_layout(hf, tmp_path, mtp), dtype="float32", with_mtp=True)
    assert_mtp_passes_match(model, ext)


def assert_mtp_passes_match(model, ext=None) -> None:
    """The fused MTP head against the model's mtp_hidden over the draft passes SpecDecoder.propose runs."""
    ref_cache = allocate_cache(model.config, num_blocks=64, block_size=BLOCK, num_slots=4, with_mtp=True)
    fused_cache = allocate_cache(model.config, num_blocks=64, block_size=BLOCK, num_slots=4, with_mtp=True)
    fused = FusedMTP(model, fused_cache, ext)
    g = torch.Generator().manual_seed(5)
    H, V = model.config.hidden_size, model.config.vocab_size
    # pass 1 over prompt positions, then single-row draft passes, as SpecDecoder.propose runs them
    for lens in ([(30, 0), (6, 0)], [(1, 30), (2, 6)], [(1, 31), (1, 8)]):
        T = sum(q for q, _ in lens)
        ids, hidden = torch.randint(0, V, (T,), generator=g), torch.randn(T, H, generator=g)
        with torch.inference_mode():
            expected = model.mtp_hidden(ids, hidden, context(ref_cache, lens))
            got = fused(ids, hidden, context(fused_cache, lens))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert_caches_equal(ref_cache, fused_cache)


def test_engine_runs_the_fused_step_unless_enforce_eager(tmp_path) -> None:
    from deltaserve import LLM, SamplingParams

    path = save_official_layout(random_hf_model(TINY, seed=6), tmp_path, random_mtp_tensors(TINY))
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 90 + 2 for j in range(5 + 9 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}):
        for eager in (True, False):
            llm = LLM(model=str(path), enforce_eager=eager, speculative_config=spec, max_num_batched_tokens=32,
                      max_model_len=256, kv_cache_memory=1 << 24)
            executor = llm.engine.executor
            assert executor.name == ("torch" if eager else "fused-cpu")
            if spec is not None and not eager:  # the draft passes run fused too
                assert isinstance(executor._mtp, FusedMTP)
            outputs[spec is not None, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len({str(v) for v in outputs.values()}) == 1  # chunked prefill, decode and verify: all agree


def test_the_fused_step_profiles_its_parts(model, ext) -> None:
    cache = allocate_cache(model.config, num_blocks=64, block_size=BLOCK, num_slots=6)
    fused = FusedTrunk(model, cache, ext)
    fused.set_profiling(True)
    with torch.inference_mode():
        fused(torch.arange(30) % model.config.vocab_size, context(cache, [(20, 0), (10, 0)]))
    parts = fused.profile()
    assert set(parts) == set(FusedTrunk.PROFILE_PARTS)
    assert parts["projections"] > 0 and parts["attention"] > 0 and parts["gdn_conv_and_recurrence"] > 0
    assert parts["forward"] > parts["projections"] + parts["attention"] + parts["gdn_conv_and_recurrence"]
    assert all(v == 0 for v in fused.profile().values())  # reading clears


def test_threads_split_the_work_without_changing_it(model, ext) -> None:
    """With enough work (8 prompts of 600 tokens, then their decodes over 600 cached positions) the step
    splits panels, sequences and attention rows over torch's threads; each of its outputs is still computed
    by one thread in one order. (MKL, for fp32-valued weights, may block its GEMM differently per thread
    count, hence a rounding-level tolerance.)"""
    B, n, blocks = 8, 600, 40  # 40 blocks of 16 = 640 positions per sequence
    tables = [list(range(blocks * b, blocks * (b + 1))) for b in range(B)]
    ids = torch.arange(B * n) % model.config.vocab_size
    results = []
    for threads in (1, 2):
        cache = allocate_cache(model.config, num_blocks=B * blocks, block_size=BLOCK, num_slots=B)
        fused = FusedTrunk(model, cache, ext)
        prompts = ForwardContext.paged(cache, [n] * B, [0] * B, tables, list(range(B)))
        decodes = ForwardContext.paged(cache, [1] * B, [n] * B, tables, list(range(B)))
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                outs = [fused(ids, prompts), fused(ids[:B], decodes)]
        finally:
            torch.set_num_threads(before)
        results.append(outs + [t.clone() for t in cache.ssm.values()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
