"""The fused step's projection kernels (deltaserve/ops/csrc/linear.cpp) per weight format, at the
Qwen3.5-0.8B projection shapes: GMAC/s, and GB/s of stored weight bytes (scales included), for 1, 8 and 512
rows at 1 and 2 threads, against torch's own matmul on the dequantized fp32 weight (what the torch path
computes), in the same run.

The machine is shared: each kernel and its torch peer are timed in alternation, `--rounds` times, and the
best of each is kept; compare the ratios, not the absolute numbers. Weights of a shape that fits in the
last-level cache (every one here but the lm_head, 254 MB in bf16) are read from it, not from memory, so their
GB/s is the cache's. The lm_head runs at 1 and 8 rows only (a prompt chunk computes the logits of its last
row alone).

    python benchmarks/bench_kernels.py [--formats bfloat16 int8] [--shapes mlp.down_proj] [--rows 1 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from deltaserve.ops.formats import FORMATS, WeightFormat, dequantize, quantize

# (N, K) of each projection at hidden 1024: GDN 16 + 16 heads of 128 (q|k|v|z|b|a), attention 8 heads of 256
# with the output gate (q|gate|k|v; 2 KV heads), MLP 3584, vocabulary 248320 (/work/shared/REFERENCE.md)
SHAPES = {
    "linear_attn.in_proj": (2 * 16 * 128 + 16 * 128 + 16 * 128 + 2 * 16, 1024),
    "linear_attn.out_proj": (1024, 2048),
    "self_attn.qkv_proj": (2 * 8 * 256 + 2 * 2 * 256, 1024),
    "mlp.gate_up_proj": (2 * 3584, 1024),
    "mlp.down_proj": (1024, 3584),
    "lm_head": (248320, 1024),
}
ROWS = (1, 8, 512)
THREADS = (1, 2)


@dataclass(slots=True)
class Result:
    shape: str
    fmt: str
    rows: int
    threads: int
    seconds: float
    torch_seconds: float
    macs: int
    weight_bytes: int


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` calls (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def repeat_for(macs: int) -> int:
    """Enough calls to time a small projection, few for a large one."""
    return max(3, min(50, int(2e9 // max(macs, 1))))


def stored_projections(shapes: list[str], formats: list[str], g: torch.Generator) -> Iterator[
        tuple[str, WeightFormat, list[tuple]]]:
    """(shape, format, parts as ext.linear takes them) of each shape's random weight stored in each format."""
    for shape in shapes:
        n, k = SHAPES[shape]
        weight = torch.randn(n, k, generator=g) * 0.02
        for name in formats:
            fmt = WeightFormat.of(name)
            data, scale = quantize(weight, fmt)
            yield shape, fmt, [(data, scale, fmt.name, fmt.group)]


def run(shapes: list[str], formats: list[str], rows: list[int], threads: list[int], rounds: int) -> list[Result]:
    from deltaserve.ops.fused_ext import load_extension

    ext = load_extension()
    results: list[Result] = []
    g = torch.Generator().manual_seed(0)
    for shape, fmt, parts in stored_projections(shapes, formats, g):
        n, k = SHAPES[shape]
        data, scale = parts[0][:2]
        dense = dequantize(data, scale, fmt, k)  # the torch path's fp32 weight
        for t in rows:
            if shape == "lm_head" and t > 8:
                continue
            x = torch.randn(t, k, generator=g)
            for nthreads in threads:
                torch.set_num_threads(nthreads)
                repeat = repeat_for(t * n * k)
                ours = theirs = float("inf")
                for _ in range(rounds):  # alternate: the machine's load changes under both alike
                    ours = min(ours, best_time(partial(ext.linear, x, parts), repeat))
                    theirs = min(theirs, best_time(partial(torch.nn.functional.linear, x, dense), repeat))
                results.append(Result(shape, fmt.name, t, nthreads, ours, theirs, t * n * k, fmt.nbytes(n, k)))
                print(format_result(results[-1]), flush=True)
        del dense, data, scale, parts
    return results


def format_result(r: Result) -> str:
    return (f"{r.shape:<22} {r.fmt:<9} rows {r.rows:>4}  threads {r.threads}  "
            f"{r.macs / r.seconds / 1e9:7.1f} GMAC/s  {r.weight_bytes / r.seconds / 1e9:7.1f} GB/s  "
            f"torch fp32 on the dequantized weight {r.macs / r.torch_seconds / 1e9:7.1f} GMAC/s  "
            f"x{r.torch_seconds / r.seconds:5.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=["bfloat16", "fp8", "int8", "int4", "float32"])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--threads", nargs="+", type=int, default=list(THREADS))
    parser.add_argument("--rounds", type=int, default=3, help="alternations of each kernel with its torch peer")
    args = parser.parse_args(argv)
    run(args.shapes, args.formats, args.rows, args.threads, args.rounds)


if __name__ == "__main__":
    main()
