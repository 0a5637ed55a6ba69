"""int8 / int4 projections with int8 activations (activation_quantization "int8": the VNNI kernel of
deltaserve/ops/csrc/linear_int.h) against the same weights' float path ("none": weights widened to fp32 in
registers), at the Qwen3.5-0.8B projection shapes: GB/s of stored weight bytes (scales included) and the
ratio, for 1 to 16 rows (decode, verify rows, batched steps) and a few prompt-chunk sizes.

The machine is shared: the two are timed in alternation, `--rounds` times, and the best of each is kept;
compare the ratios. Run it on one thread (the default) pinned to one core, e.g.
    taskset -c 1 python benchmarks/bench_int8_activations.py [--formats int8] [--rows 1 4] [--bandwidth 34.8]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from bench_kernels import SHAPES, best_time, repeat_for, stored_projections  # (the benchmarks folder: on the path)

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 64, 256)


def run(shapes: list[str], formats: list[str], rows: list[int], threads: int, rounds: int, bandwidth: float) -> None:
    from deltaserve.ops.fused_ext import load_extension

    ext = load_extension()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    for shape, fmt, parts in stored_projections(shapes, formats, g):
        n, k = SHAPES[shape]
        for t in rows:
            if shape == "lm_head" and t > 16:
                continue
            x = torch.randn(t, k, generator=g)
            repeat = repeat_for(t * n * k)
            quantized = exact = float("inf")
            for _ in range(rounds):  # alternate: the machine's load changes under both alike
                quantized = min(quantized, best_time(partial(ext.linear, x, parts, "int8"), repeat))
                exact = min(exact, best_time(partial(ext.linear, x, parts, "none"), repeat))
            nbytes = fmt.nbytes(n, k)
            print(f"{shape:<22} {fmt.name:<5} rows {t:>4}  int8 activations {nbytes / quantized / 1e9:6.1f} GB/s "
                  f"({nbytes / quantized / 1e9 / bandwidth:4.0%} of {bandwidth} GB/s)  float "
                  f"{nbytes / exact / 1e9:6.1f} GB/s  x{exact / quantized:5.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--formats", nargs="+", choices=["int8", "int4"], default=["int8", "int4"])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two paths")
    parser.add_argument("--bandwidth", type=float, default=34.8, help="the machine's memory read GB/s, for scale")
    args = parser.parse_args(argv)
    run(args.shapes, args.formats, args.rows, args.threads, args.rounds, args.bandwidth)


if __name__ == "__main__":
    main()
