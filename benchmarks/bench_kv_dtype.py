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
from deltaserve.model.context import ForwardContext  # noqa: E402
from deltaserve.model.loader import load_model  # noqa: E402
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


def closeness(model, ids: list[int]) -> list[tuple[str, float, float, float]]:
    reference = logits_with(model, ids, torch.float32)
    rows = []
    for name, dtype, rule in [
        ("fp8, per-(token, kv head) scale (deltaserve)", attention_ops.FP8, None),
        ("fp8, per-tensor scale 1.0 (vLLM's default)", attention_ops.FP8, per_tensor_unit_scale),
        ("bfloat16", torch.bfloat16, None),
    ]:
        original = attention_ops.quantize_fp8
        if rule is not None:
            attention_ops.quantize_fp8 = rule
        try:
            got = logits_with(model, ids, dtype)
        finally:
            attention_ops.quantize_fp8 = original
        diff = (got - reference).abs()
        top1 = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
        rows.append((name, diff.max().item(), diff.mean().item(), top1))
    return rows


@torch.inference_mode()
def decode_speed(model, dtypes: dict[str, torch.dtype], batch: int, context: int, steps: int,
                 rounds: int = 5) -> dict[str, tuple[float, float]]:
    """Per cache dtype, median milliseconds per decode step and of its attention over `rounds` rounds of
    `steps` steps, `batch` sequences at about `context` cached positions. The dtypes take turns round by
    round, so that load from elsewhere on a shared machine falls on both alike."""
    blocks = -(-(context + rounds * steps) // BLOCK)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    V = model.config.vocab_size
    runs = {}
    for name, dtype in dtypes.items():
        cache = allocate_cache(model.config, batch * blocks, BLOCK, batch, dtype)
        fused = FusedTrunk(model, cache)
        g = torch.Generator().manual_seed(0)
        for b in range(batch):  # the prompts, one at a time
            fused(torch.randint(0, V, (context,), generator=g),
                  ForwardContext.paged(cache, [context], [0], [tables[b]], [b]))
        fused.set_profiling(True)
        runs[name] = (cache, fused, [], [])
    for r in range(rounds):
        for cache, fused, totals, attention in runs.values():
            fused.profile()
            t0 = time.perf_counter()
            for i in range(steps):
                pos = context + r * steps + i
                fused(torch.full((batch,), 7), ForwardContext.paged(cache, [1] * batch, [pos] * batch, tables,
                                                                  list(range(batch))))
            totals.append(1000 * (time.perf_counter() - t0) / steps)
            attention.append(1000 * fused.profile()["attention"] / steps)
    return {name: (statistics.median(t), statistics.median(a)) for name, (_, _, t, a) in runs.items()}


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
    lines = [
        SECTION, "",
        f"`benchmarks/bench_kv_dtype.py`, {datetime.date.today()}, {machine()}, {torch.get_num_threads()} "
        "threads. The demo, fp32 weights and activations.", "",
        "Logits of a 512-token text with each KV cache against an fp32 cache (Python model):", "",
        "| KV cache | max abs diff | mean abs diff | top-1 agreement |", "|---|---|---|---|",
        *[f"| {name} | {mx:.4f} | {mean:.5f} | {top1:.2%} |" for name, mx, mean, top1 in close], "",
        f"Fused decode steps, {args.batch} sequences at {args.context} cached positions (median of 5 rounds of "
        f"{args.steps} steps, the two caches taking turns):",
        "", "| KV cache | ms per step | of which attention |", "|---|---|---|",
        *[f"| {name} | {step:.2f} | {attn:.2f} |" for name, (step, attn) in speed.items()], "",
    ]
    print("\n".join(lines))
    if not args.no_write:
        write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
