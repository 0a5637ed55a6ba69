"""Tensor parallelism on this machine (gloo, a worker process per rank beyond the first): TP = 2 against
TP = 1 on random checkpoints, greedy tokens identical and logits within 1e-5, through attention and GDN
head splits (TINY: KV heads split), replicated KV heads with tied embeddings (27B ratios: one KV head),
MTP speculation, prompts chunked across steps, with the fused C++ step on every rank (its all-reduce hook)
and with the torch reference executor (enforce_eager); each rank's cache held to `deltaserve plan --tp 2`; an
indivisible shape's error; a killed worker's prompt error."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.planner import plan_memory
from deltaserve.executor import TensorParallelError
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from deltaserve.model.parallel import Shard, ShardOutsideStepError
from deltaserve.model.sharding import rank_slice
from deltaserve.ops.fused_ext import load_extension
from deltaserve.sampling import SamplingParams
from tests.checkpoints import RATIOS_27B, TINY, random_hf_model, random_mtp_tensors, save_official_layout

MAX_LEN, SEQS, BLOCK = 96, 4, 16
PROMPTS = [list(range(3, 26)), [5, 9, 2, 7, 7, 1, 4, 8, 3, 6, 11], [17, 3, 40]]  # 23 tokens: chunked by 16


def make_engine(path: Path, tp: int, k: int = 0, eager: bool = False, kv: str = "auto", **weights) -> LLMEngine:
    """weights: EngineConfig's weight options (quantization, quantization_group_size)."""
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False} if k else None
    return LLMEngine(EngineConfig(
        model=str(path), tensor_parallel_size=tp, enforce_eager=eager, max_num_seqs=SEQS, max_model_len=MAX_LEN,
        num_kv_blocks=SEQS * (MAX_LEN // BLOCK), block_size=BLOCK, max_num_batched_tokens=16,
        speculative_config=spec, kv_cache_dtype=kv, **weights,
    ))


@contextlib.contextmanager
def engines(path: Path, k: int = 0, eager: bool = False, kv: str = "auto",
            **weights) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    one, two = make_engine(path, 1, k, eager, kv, **weights), make_engine(path, 2, k, eager, kv, **weights)
    try:
        name = "torch" if eager else "fused-cpu"
        assert (one.executor.name, two.executor.name) == (name, f"{name}-tp")
        yield one, two
    finally:
        two.close()


def greedy(engine: LLMEngine, max_tokens: int = 14, prompts: list[list[int]] = PROMPTS) -> dict[str, list[int]]:
    """Each prompt's greedy tokens (request ids r0, r1, ...), all of them batched in one engine."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


@torch.inference_mode()
def logits_of_steps(engine: LLMEngine, mtp: bool) -> list[torch.Tensor]:
    """Logits of every row of a two-sequence prefill, then of a decode step after it (and of the MTP
    head over the prefill), run through the engine's executor on blocks and slots no request holds."""
    ex, cache = engine.executor, engine.cache_tensors
    ids = torch.tensor(PROMPTS[1] + PROMPTS[2])
    ctx = ForwardContext.paged(cache, [11, 3], [0, 0], [[0], [1]], [0, 1])
    hidden = ex.forward(ids, ctx)
    out = [ex.compute_logits(hidden)]
    if mtp:
        mctx = ForwardContext.paged(cache, [11, 3], [0, 0], [[2], [3]], [0, 1])
        out.append(ex.compute_logits(ex.mtp_hidden(torch.roll(ids, -1), hidden, mctx)))
    step = ForwardContext.paged(cache, [1, 1], [11, 3], [[0], [1]], [0, 1])
    hidden = ex.forward(torch.tensor([30, 31]), step)
    out.append(ex.compute_logits(hidden, [1, 0]))
    assert torch.equal(ex.greedy_tokens(hidden), out[-1].argmax(-1).flip(0))
    return out


def assert_logits_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eager", [False, True], ids=["fused", "torch"])
def test_attention_and_gdn_head_splits_with_mtp_and_chunked_prompts(tmp_path: Path, eager: bool) -> None:
    """TINY over 2 ranks: 2 of 4 query heads, 1 of 2 KV heads, 1 of 2 GDN key heads with 2 of 4 value
    heads, half the MLP, 64 of 128 padded vocabulary rows (96 real); MTP drafts 2 tokens per step."""
    path = save_official_layout(random_hf_model(TINY, seed=5), tmp_path, random_mtp_tensors(TINY, seed=6))
    with engines(path, k=2, eager=eager) as (one, two):
        assert_logits_close(logits_of_steps(one, mtp=True), logits_of_steps(two, mtp=True))
        assert greedy(two) == greedy(one)
        assert two.spec_metrics.num_drafts == one.spec_metrics.num_drafts > 0  # verify steps ran
        assert two.spec_metrics.accepted_per_position == one.spec_metrics.accepted_per_position
        with pytest.raises(ShardOutsideStepError, match="rank 0 of 2"):  # not a hang without the workers
            two.model(torch.tensor([1, 2]), ForwardContext.stateless([2]))
        step = ForwardContext.paged(two.cache_tensors, [1], [0], [[0]], [0])
        with pytest.raises(ShardOutsideStepError, match="rank 0 of 2"):  # the fused step's hook raises it too
            two.executor.local.forward(torch.tensor([3]), step)
        assert greedy(two, max_tokens=3) == greedy(one, max_tokens=3)  # and the ranks are still in step


def test_fp8_kv_cache_on_every_rank(tmp_path: Path) -> None:
    """Each rank's fused step over its KV heads' fp8 cache (codes and row scales): the tokens of one rank."""
    path = save_official_layout(random_hf_model(TINY, seed=3), tmp_path)
    with engines(path, kv="fp8") as (one, two):
        assert all(k.dtype == torch.float8_e4m3fn for pair in two.cache_tensors.kv.values() for k in pair)
        assert two.cache_tensors.kv_scales
        assert greedy(two) == greedy(one)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_on_every_rank(tmp_path: Path, quantization: str) -> None:
    """Each rank quantizes its own part of every projection as it loads. With groups of 8 columns, which every
    rank's slice of a row-parallel projection holds whole (TINY: 40 MLP, 32 attention, 24 GDN columns per
    rank), the ranks store exactly the one-process model's values, so with float activations their logits and
    tokens are its own. With int8 activations (the default for these weights) the row-parallel sums, added in
    another order by the all-reduce, can put a next layer's input an ulp to the other side of an int8
    rounding step: logits then agree to about one quantization step of an activation, not to fp32 rounding."""
    path = save_official_layout(random_hf_model(TINY, seed=4), tmp_path, random_mtp_tensors(TINY, seed=5))
    weights = dict(quantization=quantization, quantization_group_size=8)
    with engines(path, k=2, activation_quantization="none", **weights) as (one, two):
        assert two.model.model.layers[0].mlp.down_proj.fmt.name == quantization
        assert_logits_close(logits_of_steps(one, mtp=True), logits_of_steps(two, mtp=True))
        assert greedy(two) == greedy(one)
    with engines(path, k=2, **weights) as (one, two):
        assert two.config.activation_quantization == "int8"
        for x, y in zip(logits_of_steps(one, mtp=True), logits_of_steps(two, mtp=True), strict=True):
            torch.testing.assert_close(x, y, atol=3e-2, rtol=0)


def test_replicated_kv_heads_tied_embeddings_and_the_plan(tmp_path: Path) -> None:
    """27B ratios over 2 ranks: 3 of 6 query heads, the one KV head on both (vLLM's replication), 1 of 2
    GDN key heads with 3 of 6 value heads, tied vocab-parallel embedding. Each rank's cache tensors are
    what `deltaserve plan --tp 2` reports per rank, and so are rank 0's weights."""
    path = save_official_layout(random_hf_model(RATIOS_27B, seed=7, tie=True), tmp_path)
    with engines(path) as (one, two):
        assert_logits_close(logits_of_steps(one, mtp=False), logits_of_steps(two, mtp=False))
        assert greedy(two) == greedy(one)
        cfg = ModelConfig.from_file(path)
        snapshots = two.cache.prefix.snapshots.num_total  # prefix caching is on: each rank holds the entries
        plan = plan_memory(cfg, MAX_LEN, SEQS, tp=2, block_size=BLOCK, dtype="float32", num_gdn_snapshots=snapshots)
        assert plan.rank.kv_heads == 1 and two.executor.cache_bytes_per_rank() == [plan.cache_bytes] * 2
        one_rank = plan_memory(cfg, MAX_LEN, SEQS, tp=1, block_size=BLOCK, dtype="float32", num_gdn_snapshots=snapshots)
        assert plan.cache_bytes < one_rank.cache_bytes
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in two.model.parameters()}  # tied once
        assert sum(weights.values()) == plan.weight_bytes


def test_a_rank_without_the_fused_step_puts_every_rank_on_the_torch_executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 cannot build the C++ step (no compiler there), rank 0 has it: the ranks' collectives must pair
    up (the fused step's last layer all-reduces only the rows asked for), so both run torch, still right."""
    path = save_official_layout(random_hf_model(TINY, seed=5), tmp_path)
    load_extension()  # rank 0's build, before the worker's environment loses the compiler
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    one, two = make_engine(path, 1), make_engine(path, 2)
    try:
        assert (one.executor.name, two.executor.name) == ("fused-cpu", "torch-tp")
        assert greedy(two) == greedy(one)
    finally:
        two.close()


def ranks_hold_their_slices(path: Path) -> tuple[dict, list[dict], ModelConfig]:
    """The whole model's parameters and each of two ranks' (loaded without a process group), having checked
    that each rank's is rank_slice of the whole one's; and the config."""
    whole = dict(load_model(path).named_parameters())
    ranks = [dict(load_model(path, shard=Shard(r, 2)).named_parameters()) for r in range(2)]
    cfg = ModelConfig.from_file(path)
    for name, p in whole.items():
        for r in range(2):
            assert torch.equal(ranks[r][name], rank_slice(name, p, cfg, r, 2)), name
    return whole, ranks, cfg


def test_each_rank_reads_its_part_of_every_tensor(tmp_path: Path) -> None:
    """Without a process group: the two ranks' parameters (read as safetensors slices) are the whole
    model's split by heads, laid out as the layers expect; replicated ones are whole."""
    path = save_official_layout(random_hf_model(TINY, seed=4), tmp_path, random_mtp_tensors(TINY, seed=4))
    whole, ranks, cfg = ranks_hold_their_slices(path)
    layer = "model.layers.0.linear_attn."
    kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
    qkv = [ranks[r][layer + "in_proj_qkv.weight"] for r in range(2)]  # each [q | k | v] of its heads
    half = [kd // 2, kd // 2, vd // 2]
    joined = [torch.cat([q.split(half)[i] for q in qkv]) for i in range(3)]
    assert torch.equal(torch.cat(joined), whole[layer + "in_proj_qkv.weight"])
    o = "model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([ranks[0][o], ranks[1][o]], dim=1), whole[o])
    emb = "model.embed_tokens.weight"  # 96 rows padded to 128: rank 1 holds 32 real and 32 zero rows
    assert torch.equal(torch.cat([ranks[0][emb], ranks[1][emb]])[:96], whole[emb])
    assert not ranks[1][emb][32:].any()
    assert torch.equal(ranks[1]["mtp.fc.weight"], whole["mtp.fc.weight"])


def test_killed_worker_fails_the_next_step_naming_its_rank(tmp_path: Path) -> None:
    path = save_official_layout(random_hf_model(TINY, seed=8), tmp_path)
    engine = make_engine(path, 2)
    try:
        engine.executor.workers[0].kill()
        engine.executor.workers[0].wait()
        with pytest.raises(TensorParallelError, match="worker rank 1 .* exited"):
            engine.check_health()
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="worker rank 1"):
            engine.step()
        assert time.monotonic() - started < 5  # the liveness check, not a collective's timeout
    finally:
        engine.close()


def test_worker_killed_while_generating_stops_the_engine_promptly(tmp_path: Path) -> None:
    """Killed at some point of a long generation: inside a collective or between calls, the step raises
    (the collective fails on the closed connection, not after its timeout) and names the rank."""
    path = save_official_layout(random_hf_model(dict(TINY, max_position_embeddings=2048), seed=9), tmp_path)
    engine = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, max_num_seqs=2, max_model_len=2048,
                                    num_kv_blocks=2 * 128))
    killed: list[float] = []

    def kill() -> None:
        time.sleep(0.5)
        engine.executor.workers[0].kill()
        killed.append(time.monotonic())

    try:
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True))
        engine.step()
        killer = threading.Thread(target=kill)
        killer.start()
        with pytest.raises(TensorParallelError, match="worker rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
        killer.join()
        assert time.monotonic() - killed[0] < 10  # far inside the 120 s collective timeout
    finally:
        engine.close()


@pytest.mark.parametrize(("shape", "tp", "message"), [
    (TINY, 3, r"tensor parallel size 3 must be a multiple of num_key_value_heads \(2\)"),
    (dict(TINY, num_attention_heads=6), 4, r"num_attention_heads \(6\) is not divisible by tensor parallel size 4"),
    (dict(TINY, num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=1, linear_num_value_heads=2),
     2, r"linear_num_key_heads \(1\) is not divisible by tensor parallel size 2"),
])
def test_indivisible_shapes_fail_before_any_worker_starts(tmp_path: Path, shape: dict, tp: int,
                                                            message: str) -> None:
    path = save_official_layout(random_hf_model(shape, seed=1), tmp_path)
    with pytest.raises(ConfigError, match=message):
        make_engine(path, tp)
