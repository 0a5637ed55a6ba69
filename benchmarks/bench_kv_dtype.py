"""The fp8 KV cache against the fp32 one on the demo (not a test): how close the logits stay under each scale
rule, and what it does to decode speed at a long context.

    .venv/bin/python benchmarks/bench_kv_dtype.py [--context 4000] [--batch 8] [--no-write]

Closeness: one 512-token text (the demo's README samples) run through the Python model with the cache
dtype in question, every position's logits against those with an fp32 cache: the largest and mean absolute
difference, and how often the top token agrees. Rules: deltaserve's per-(token, kv head) scale (amax / 448,
set on write), vLLM's default per-tensor scale of 1.0 (no calibration: clip to +-448, then cast), and a
bf16 cache for comparison. Speed: the fused step's decode steps for `batch` sequences at `context` cached
positions, whole step and its attention part (the step's own profile), fp32 against fp8.

The table goes into docs/benchmarks.md under "fp8 KV cache" (that section is replaced)."""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import machine, write_section  # noqa: E402

import deltaserve.ops.attention as attention_ops  # noqa: E402
from deltaserve.assets import demo_checkpoint_path  # noqa: E402
from deltaserve.cache.tensors import allocate_cache  # noqa: E402
from deltaserve.executor.fused_cpu.stack import FusedTrunk  # noqa: E402
from deltaserve.model.context import CacheTensors, ForwardContext  # noqa: E402
from deltaserve.model.loader import load_model  # noqa: E402
from deltaserve.ops.fused_ext import load_extension  # noqa: E402
from deltaserve.tokenizer import Tokenizer  # noqa: E402

SECTION = "## fp8 KV cache"
BLOCK = 16


def per_tensor_unit_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's default without calibrated scales: k_scale = v_scale = 1.0, values beyond E4M3's range clipped."""
    x = x.float()
    return x.clamp(-attention_ops.FP8_MAX, attention_ops.FP8_MAX).to(attention_ops.FP8), x.new_ones(x.shape[:-1])


def text_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    text = (demo_checkpoint_path() / "README.md").read_text()
    ids = tokenizer.encode(text[text.index("## Samples"):])
    return (ids * (n // len(ids) + 1))[:n]


@torch.inference_mode()
def logits_with(model, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = len(ids)
    cache = allocate_cache(model.config, -(-n // BLOCK), BLOCK, 1, dtype)
    ctx = ForwardContext.paged(cache, [n], [0], [list(range(-(-n // BLOCK)))], [0])
    return model.compute_logits(model(torch.tensor(ids), ctx))


@torch.no_grad()
def scale_values(model, factor: float) -> None:
    """The same function with V rows `factor` times their size: every attention layer's v_proj times factor,
    its o_proj divided by it (attention and the output gate are linear in V)."""
    for layer in model.model.layers:
        if layer.layer_type == "full_attention":
            layer.self_attn.v_proj.weight.mul_(factor)
            layer.self_attn.o_proj.weight.div_(factor)


def closeness(model, ids: list[int]) -> list[tuple[str, float, float, float]]:
    rows = []
    for factor in (1.0, 1e-3, 1e3):
        scale_values(model, factor)
        try:
            rows += closeness_rows(model, ids, "" if factor == 1.0 else f", V rows x {factor:g}")
        finally:
            scale_values(model, 1 / factor)
    return rows


def closeness_rows(model, ids: list[int], suffix: str) -> list[tuple[str, float, float, float]]:
    reference = logits_with(model, ids, torch.float32)
    rows = []
    for name, dtype, rule in [
        ("fp8, per-(token, kv head) scale (deltaserve)", attention_ops.FP8, None),
        ("fp8, per-tensor scale 1.0 (vLLM's default)", attention_ops.FP8, per_tensor_unit_scale),
        ("bfloat16", torch.bfloat16, None),
    ][: 3 if not suffix else 2]:
        original = attention_ops.quantize_fp8
        if rule is not None:
            attention_ops.quantize_fp8 = rule
        try:
            got = logits_with(model, ids, dtype)
        finally:
            attention_ops.quantize_fp8 = original
        diff = (got - reference).abs()
        top1 = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
        rows.append((name + suffix, diff.max().item(), diff.mean().item(), top1))
    return rows


def fill_random(cache) -> None:
    """Random K/V in every block (fp8: their codes and scales), as if prompts had been cached: the decode
    steps' time does not depend on the values, and no prompt has to run first."""
    g = torch.Generator().manual_seed(0)
    for layer, (k, v) in cache.kv.items():
        if layer not in cache.kv_scales:
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
            continue
        k_scale, v_scale = cache.kv_scales[layer]
        codes, scale = attention_ops.quantize_fp8(torch.randn(k.shape, generator=g).transpose(2, 3))
        k.copy_(codes.transpose(2, 3))
        k_scale.copy_(scale)
        codes, scale = attention_ops.quantize_fp8(torch.randn(v.shape, generator=g))
        v.copy_(codes)
        v_scale.copy_(scale)


def interleaved(runs: dict[str, object], rounds: int = 5) -> dict[str, tuple[float, float]]:
    """runs: name -> a function timing one round, returning (ms per step, ms of attention per step). The
    runs take turns round by round, so that load from elsewhere on a shared machine falls on each alike;
    the median round of each."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run())
    return {name: (statistics.median(t for t, _ in ts), statistics.median(a for _, a in ts))
            for name, ts in times.items()}


@torch.inference_mode()
def decode_speed(model, dtypes: dict[str, torch.dtype], batch: int, context: int,
                 steps: int) -> dict[str, tuple[float, float]]:
    """Per cache dtype, the fused step's milliseconds per decode step and of its attention, `batch`
    sequences at `context` cached positions."""
    blocks = -(-(context + 1) // BLOCK)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]

    def timer(dtype: torch.dtype):
        cache = allocate_cache(model.config, batch * blocks, BLOCK, batch, dtype)
        fill_random(cache)
        fused = FusedTrunk(model, cache)
        fused.set_profiling(True)
        ctx = ForwardContext.paged(cache, [1] * batch, [context] * batch, tables, list(range(batch)))
        ids = torch.full((batch,), 7)

        def run() -> tuple[float, float]:
            fused.profile()
            t0 = time.perf_counter()
            for _ in range(steps):  # the same position again: the same work every step
                fused(ids, ctx)
            return 1000 * (time.perf_counter() - t0) / steps, 1000 * fused.profile()["attention"] / steps
        return run

    return interleaved({name: timer(dtype) for name, dtype in dtypes.items()})


@torch.inference_mode()
def kernel_speed(batch: int, context: int, nh: int, nkv: int, hd: int, steps: int) -> dict[str, tuple[float, float]]:
    """The attention kernel alone (ops/csrc paged_attention) for one layer, one decode query per sequence at
    `context` cached positions, per cache dtype: milliseconds per call (twice, in interleaved's shape)."""
    ext = load_extension()
    blocks = -(-context // BLOCK)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    q = torch.randn(batch, nh, hd)
    positions, qsl = torch.full((batch,), context - 1), torch.arange(batch + 1)
    k_shape, v_shape = attention_ops.kv_cache_shapes(batch * blocks, BLOCK, nkv, hd)

    def timer(dtype: torch.dtype):
        kv = CacheTensors(kv={0: (torch.empty(k_shape, dtype=dtype), torch.empty(v_shape, dtype=dtype))}, conv={},
                          ssm={})
        if dtype == attention_ops.FP8:
            kv.kv_scales[0] = tuple(torch.empty(s) for s in attention_ops.kv_scale_shapes(batch * blocks, BLOCK, nkv))
        fill_random(kv)
        args = (*kv.kv[0], positions, qsl, tables, 8 << 20, *kv.kv_scales.get(0, ()))

        def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            for _ in range(steps):
                ext.paged_attention(q, *args)
            ms = 1000 * (time.perf_counter() - t0) / steps
            return ms, ms
        return run

    return interleaved({"float32": timer(torch.float32), "fp8": timer(attention_ops.FP8)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    path = demo_checkpoint_path()
    model = load_model(path, "float32")
    ids = text_ids(Tokenizer.from_dir(path), 512)
    close = closeness(model, ids)
    speed = decode_speed(model, {"float32": torch.float32, "fp8": attention_ops.FP8}, args.batch, args.context,
                         args.steps)
    # Qwen3.5-0.8B's attention layer: 8 query heads, 2 KV heads of 256 (REFERENCE.md, "Released shapes")
    kernel = kernel_speed(args.batch, args.context, 8, 2, 256, args.steps)
    kv_mb = {name: args.batch * args.context * 2 * 2 * 256 * (4 if name == "float32" else 1 + 4 / 256) / 1e6
             for name in kernel}
    lines = [
        SECTION, "",
        f"`benchmarks/bench_kv_dtype.py`, {datetime.date.today()}, {machine()}, {torch.get_num_threads()} "
        "threads. The demo, fp32 weights and activations.", "",
        "Logits of a 512-token text with each KV cache against an fp32 cache (Python model); then the same with",
        "the demo rescaled to compute the same function with V rows 1000 times smaller or larger (v_proj times",
        "the factor, o_proj divided by it), as a checkpoint with other activation sizes would have:", "",
        "| KV cache | max abs diff | mean abs diff | top-1 agreement |", "|---|---|---|---|",
        *[f"| {name} | {mx:.4f} | {mean:.5f} | {top1:.2%} |" for name, mx, mean, top1 in close], "",
        f"Fused decode steps, {args.batch} sequences at {args.context} cached positions (median of 5 rounds of "
        f"{args.steps} steps, the two caches taking turns):",
        "", "| KV cache | ms per step | of which attention |", "|---|---|---|",
        *[f"| {name} | {step:.2f} | {attn:.2f} |" for name, (step, attn) in speed.items()], "",
        f"The attention kernel alone at Qwen3.5-0.8B's attention shape (8 query heads, 2 KV heads of 256), "
        f"{args.batch} decode queries at {args.context} cached positions, one layer:", "",
        "| KV cache | K/V bytes read | ms per call | GB/s |", "|---|---|---|---|",
        *[f"| {name} | {kv_mb[name]:.1f} MB | {ms:.2f} | {kv_mb[name] / ms:.1f} |"
          for name, (ms, _) in kernel.items()], "",
    ]
    print("\n".join(lines))
    if not args.no_write:
        write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
