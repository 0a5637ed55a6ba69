"""The fused C++ step's sparse-MoE MLP (deltaserve/ops/csrc/moe.cpp) against the Python model (the torch
executor's forward) on small random MoE checkpoints of both families and both expert layouts: hidden states,
logits and caches over prompt chunks, decodes and verify segments, with fp32 weights (some bf16-valued), in the
native and the portable build; routing ties, an expert no token picks, mlp_only_layers and
decoder_sparse_step; the MoE MTP head; experts stored as bf16, read where they are (no copies)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.config import ModelConfig
from deltaserve.engine.planner import plan_memory
from deltaserve.executor.fused_cpu.stack import FusedMTP, FusedTrunk
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from deltaserve.model.moe import SparseMoeBlock
from deltaserve.ops.fused_ext import load_extension
from tests.checkpoints import MOE, RATIOS_27B, TINY, random_hf_moe_model, random_mtp_tensors
from tests.test_fused_step import BLOCK, assert_caches_equal, assert_mtp_passes_match, context, junk_cache
from tests.test_moe_model import CASES, save, tied_router_models

CASES_BF16 = {**CASES, "qwen3_5_moe-27b-ratios-bf16-values": ("qwen3_5_moe", RATIOS_27B, {}, "causal", True)}

# (query_len, context_len) per sequence, and which are verify segments: fresh prompts over several of the
# attention loop's work items, a continued chunk beside a short one, a decode beside a verify of 4, a prompt
# tail and fresh short prompts, then decodes.
STEPS = [
    ([(20, 0), (37, 0), (5, 0)], None),
    ([(18, 20), (3, 37)], None),
    ([(1, 38), (4, 40), (3, 5), (2, 0), (1, 0)], [False, True, False, False, False]),
    ([(1, 39), (1, 44), (1, 8), (1, 2), (1, 2)], None),
]


def bf16_values(hf) -> None:
    """A bf16 checkpoint computed in fp32: every weight a bf16 number."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())


@pytest.fixture(scope="module", params=list(CASES_BF16))
def model(request, tmp_path_factory):
    family, shape, fields, layout, fused = CASES_BF16[request.param]
    hf = random_hf_moe_model(family, shape, seed=len(request.param), **fields)
    if request.param.endswith("bf16-values"):
        bf16_values(hf)
    return load_model(save(hf, tmp_path_factory.mktemp(request.param), layout, fused), dtype="float32")


def assert_steps_match(model, ext=None, steps=STEPS, seed: int = 3) -> None:
    """Each step through the Python model and the fused trunk, on caches of the same junk: same hidden
    states, logits, verify states and cache writes."""
    ref_cache, fused_cache = junk_cache(model, 0), junk_cache(model, 0)
    fused = FusedTrunk(model, fused_cache, ext)
    g = torch.Generator().manual_seed(seed)
    for lens, verify in steps:
        ids = torch.randint(0, model.config.vocab_size, (sum(q for q, _ in lens),), generator=g)
        ref_ctx, fused_ctx = context(ref_cache, lens, verify), context(fused_cache, lens, verify)
        with torch.inference_mode():
            expected, got = model(ids, ref_ctx), fused(ids, fused_ctx)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(fused.logits(got), model.compute_logits(expected), atol=1e-4, rtol=1e-4)
            assert torch.equal(fused.greedy_tokens(got), model.compute_logits(expected).argmax(-1))
        for layer, (conv, ssm) in ref_ctx.spec_states.items():
            n = max(q for (q, _), v in zip(lens, verify or [], strict=True) if v)
            got_conv, got_ssm = fused_ctx.spec_states[layer]
            torch.testing.assert_close(got_conv[:, :n], conv[:, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got_ssm[:, :n], ssm[:, :n], atol=1e-4, rtol=1e-4)
        # 3e-4: the 27B-ratio case's cached keys, after several steps through 256-wide experts, differ by up to
        # 1.5e-4 (one value of 32768) with the AVX2 kernels' order of fp32 sums (8 lanes; 4 accumulators a row)
        assert_caches_equal(ref_cache, fused_cache, tol=3e-4)


def test_fused_moe_steps_match_the_python_model(model) -> None:
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    assert_steps_match(model)


@pytest.mark.parametrize("case", ["qwen3_next-mlp-only-layer", "qwen3_5_moe-27b-ratios-bf16-values"])
def test_the_portable_build_runs_the_moe_block(case, tmp_path) -> None:
    family, shape, fields, layout, fused = CASES_BF16[case]
    hf = random_hf_moe_model(family, shape, seed=1, **fields)
    if case.endswith("bf16-values"):
        bf16_values(hf)
    model = load_model(save(hf, tmp_path, layout, fused), dtype="float32")
    assert_steps_match(model, load_extension(portable=True))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_routing_ties_break_as_the_python_model(family, tmp_path) -> None:
    """A zero router (all experts tie) and routers of repeated rows (tests/test_moe_model.py)."""
    assert_steps_match(tied_router_models(family, tmp_path)[1])


def test_an_expert_no_token_picks_is_never_read(tmp_path) -> None:
    """Per MoE layer the experts none of the tokens choose get NaN weights: the fused step must not read them
    (a prompt of 2 tokens, then one decode token)."""
    hf = random_hf_moe_model("qwen3_5_moe", TINY, seed=8)
    model = load_model(save(hf, tmp_path, "official", fused=True), dtype="float32")
    ids = torch.tensor([5, 17, 42])
    chosen: dict[SparseMoeBlock, set[int]] = {}

    def record(mlp, args, out) -> None:  # the experts each layer's routing picks for the prompt's tokens
        chosen.setdefault(mlp, set()).update(mlp.route(args[0])[0].flatten().tolist())

    hooks = [layer.mlp.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(ids, ForwardContext.stateless([3]))
        for hook in hooks:
            hook.remove()
        for mlp, picked in chosen.items():
            unused = sorted(set(range(MOE["num_experts"])) - picked)
            assert unused, "every expert was picked; use a shorter prompt"
            mlp.experts.gate_up_proj[unused] = float("nan")
            mlp.experts.down_proj[unused] = float("nan")
    cache, ref_cache = junk_cache(model, 1), junk_cache(model, 1)
    fused = FusedTrunk(model, cache)
    for chunk, start in ((ids[:2], 0), (ids[2:], 2)):
        with torch.inference_mode():
            got = fused(chunk, context(cache, [(len(chunk), start)]))
            want = model(chunk, context(ref_cache, [(len(chunk), start)]))
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, layout, values", [("qwen3_5_moe", "official", "fp32"),
                                                    ("qwen3_next", "causal", "bf16-values")])
def test_fused_mtp_of_a_moe_checkpoint_matches_the_python_head(family, layout, values, tmp_path) -> None:
    hf = random_hf_moe_model(family, RATIOS_27B, seed=9)
    mtp = random_mtp_tensors(RATIOS_27B, seed=2, moe=MOE)
    if values == "bf16-values":
        bf16_values(hf)
        mtp = {k: v.bfloat16().float() for k, v in mtp.items()}
    model = load_model(save(hf, tmp_path, layout, fused=False, mtp=mtp), dtype="float32", with_mtp=True)
    assert isinstance(model.mtp.layers[0].mlp, SparseMoeBlock)
    assert_mtp_passes_match(model)


@pytest.mark.parametrize("family, fields", [("qwen3_5_moe", {}), ("qwen3_next", {"mlp_only_layers": [1]})])
def test_the_fused_moe_step_holds_no_weight_copies(family, fields, tmp_path) -> None:
    """A bf16 MoE checkpoint with its experts stored as bf16: the fused trunk and MTP head read the experts'
    3-D tensors themselves (no per-expert copies), and the planner counts nothing beside the weights."""
    hf = random_hf_moe_model(family, TINY, seed=3, **fields).to(torch.bfloat16)
    mtp = {k: v.bfloat16() for k, v in random_mtp_tensors(TINY, moe=MOE).items()}
    path = save(hf, tmp_path, "official" if family == "qwen3_5_moe" else "causal", fused=True, mtp=mtp)
    plan = plan_memory(ModelConfig.from_file(path), 64, 1, dtype="float32", with_mtp=True)
    assert plan.total_bytes == plan.weight_bytes + plan.cache_bytes
    model = load_model(path, dtype="float32", with_mtp=True)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                for name in ("gate_up_proj", "down_proj"):
                    tensor = getattr(module.experts, name)
                    setattr(module.experts, name, torch.nn.Parameter(tensor.detach().bfloat16(), requires_grad=False))
    cache = allocate_cache(model.config, num_blocks=4, block_size=BLOCK, num_slots=1, with_mtp=True)
    held = FusedTrunk(model, cache).named_tensors() + FusedMTP(model, cache).named_tensors()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    experts = [(name, t) for name, t in held if ".experts." in name]
    assert experts and all(t.dtype == torch.bfloat16 and t.dim() == 3 for _, t in experts)
    assert all(t.untyped_storage().data_ptr() in params for _, t in experts)


def test_threads_split_the_experts_without_changing_the_sums(tmp_path) -> None:
    """Experts wide enough that a decode step's experts go to separate threads (moe.cpp), and a prompt of more
    than kExpertParallelRows rows whose experts split their outputs instead: the same hidden states with 1 and
    2 threads (each expert's rows by one thread, added in expert order; bf16 values)."""
    hf = random_hf_moe_model("qwen3_5_moe", dict(TINY, hidden_size=256), seed=4,
                             moe_intermediate_size=1024)
    bf16_values(hf)
    model = load_model(save(hf, tmp_path, "causal", True), dtype="float32")
    results = []
    for threads in (1, 2):
        cache = junk_cache(model, 2)
        fused = FusedTrunk(model, cache)
        ids = torch.arange(60) % model.config.vocab_size
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                results.append([fused(ids[:40], context(cache, [(40, 0)])),
                                fused(ids[:6], context(cache, [(1, 40)] + [(1, 0)] * 5))])
        finally:
            torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_expert_tensors_of_the_wrong_shape_are_named(tmp_path) -> None:
    hf = random_hf_moe_model("qwen3_5_moe", TINY, seed=2)
    model = load_model(save(hf, tmp_path, "causal", True), dtype="float32")
    model.config.moe_intermediate_size += 1  # what the C++ stack expects no longer matches the experts
    E, H, I = MOE["num_experts"], TINY["hidden_size"], MOE["moe_intermediate_size"]
    with pytest.raises(RuntimeError, match=rf"layer 0 mlp.experts.gate_up_proj: expected \[{E}, {2 * I + 2}, {H}\]"):
        FusedTrunk(model, junk_cache(model, 0))
