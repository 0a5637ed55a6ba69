"""A tile kernel of int8-activation projections, AMX-INT8 (deltaserve/ops/csrc/linear_amx.h) or the AVX512-VNNI
tiles (linear_vnni.h), against the path the same call takes without either (the VNNI integer kernel up to
INT_KERNEL_ROWS rows, the packed fp32 kernel over x~ = q_x * s_x past them), at the Qwen3.5-0.8B projection
shapes; and, with --bf16, the fused step's kernels on bf16 weights: the packed fp32 one against the bf16-pair
one (activation_quantization "bf16") and torch's bf16 matmul (oneDNN, which may use AMX-BF16).

One process, the kernel switched on and off (ext.set_amx, ext.set_vnni_tiles) and timed in alternation,
`--rounds` times, the best of each kept: compare the ratios (old / new: > 1 means the kernel is faster). On one
thread the time is the thread's CPU time (a shared machine's preemptions do not count; its caches and memory
bandwidth still do), on more the wall time. The kernel takes every row count given (its rows threshold set to
1), so that the threshold can be chosen from the ratios. --kernel: amx where the CPU has it, else vnni.
    PYTHONPATH=. python benchmarks/bench_tile_kernels.py [--kernel vnni] [--shapes mlp.gate_up_proj] [--rows 16 32]
    PYTHONPATH=. python benchmarks/bench_tile_kernels.py --bf16 [--rows 64 512]
    PYTHONPATH=. python benchmarks/bench_tile_kernels.py --prefill int8 --rows 512 --threads 1   # the engine

--prefill: the engine on bench_formats.py's random Qwen3.5-0.8B checkpoint (written there once), quantized to
the format, one prompt of --rows tokens in one chunk, the kernel on and off in alternation (2 rounds, the best
of each).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from bench_kernels import SHAPES, best_time, repeat_for, stored_projections  # (the benchmarks folder: on the path)


def cpu_time(fn: Callable[[], object], repeat: int) -> float:
    """The least thread CPU time of `repeat` calls (after one warm-up), in seconds: one thread's work only."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def timer(threads: int) -> Callable[[Callable[[], object], int], float]:
    return cpu_time if threads == 1 else best_time


def alternating(threads: int, first: Callable[[], object], second: Callable[[], object], rounds: int,
                repeat: int) -> tuple[float, float]:
    """The best time of each of two calls, timed in alternation for `rounds` rounds on `threads` threads."""
    torch.set_num_threads(threads)
    clock = timer(threads)
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, fn in enumerate((first, second)):
            best[i] = min(best[i], clock(fn, repeat))
    return best[0], best[1]


def use_kernel(ext, kernel: str, on: bool) -> None:
    """The tile kernel `kernel` on (the other one off) or both off."""
    ext.set_amx(on and kernel == "amx")
    ext.set_vnni_tiles(on and kernel == "vnni")


def with_kernel(ext, kernel: str, on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the tile kernel switched on or off for the call (and back on after it)."""
    def call() -> object:
        use_kernel(ext, kernel, on)
        try:
            return fn()
        finally:
            use_kernel(ext, kernel, True)
    return call

ROWS = (16, 24, 32, 48, 64, 128, 256, 512)


def run_int8(ext, kernel: str, shapes: list[str], formats: list[str], rows: list[int], threads: list[int],
             rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    for shape, fmt, parts in stored_projections(shapes, formats, g):
        n, k = SHAPES[shape]
        for t in rows:
            x = torch.randn(t, k, generator=g)
            for nthreads in threads:
                project = partial(ext.linear, x, parts, "int8")
                new, old = alternating(nthreads, with_kernel(ext, kernel, True, project),
                                       with_kernel(ext, kernel, False, project), rounds,
                                       max(2, repeat_for(t * n * k) // 2))
                gmacs = t * n * k / 1e9
                print(f"{shape:<22} {fmt.name:<5} rows {t:>4} threads {nthreads}  {kernel} {new * 1e3:8.3f} ms "
                      f"({gmacs / new:6.1f} GMAC/s)  old {old * 1e3:8.3f} ms ({gmacs / old:6.1f} GMAC/s)  "
                      f"old/{kernel} x{old / new:5.2f}", flush=True)


def run_bf16(ext, shapes: list[str], rows: list[int], threads: list[int], rounds: int) -> None:
    """bf16 weights: the packed fp32 kernel on x (activation_quantization "none") against the bf16-pair kernel
    on x rounded to bf16 ("bf16", vdpbf16ps where the build has AVX512-BF16) and against torch's bf16 matmul."""
    g = torch.Generator().manual_seed(0)
    for shape, _, parts in stored_projections(shapes, ["bfloat16"], g):
        n, k = SHAPES[shape]
        w = parts[0][0]  # bf16 [N, K]
        for t in rows:
            x = torch.randn(t, k, generator=g)
            for nthreads in threads:
                repeat = max(2, repeat_for(t * n * k) // 2)
                ours, pairs = alternating(nthreads, partial(ext.linear, x, parts, "none"),
                                          partial(ext.linear, x, parts, "bf16"), rounds, repeat)
                _, theirs = alternating(nthreads, partial(ext.linear, x, parts, "none"),
                                        lambda x=x, w=w: (x.bfloat16() @ w.T).float(), rounds, repeat)
                gmacs = t * n * k / 1e9
                print(f"{shape:<22} bf16  rows {t:>4} threads {nthreads}  packed fp32 {gmacs / ours:6.1f} GMAC/s  "
                      f"bf16 pairs {gmacs / pairs:6.1f} GMAC/s (x{ours / pairs:4.2f})  torch bf16 "
                      f"{gmacs / theirs:6.1f} GMAC/s (x{ours / theirs:4.2f})", flush=True)


def run_prefill(ext, kernel: str, fmt: str, prompt: int, threads: int, rounds: int) -> None:
    from bench_formats import checkpoint

    from deltaserve.engine.llm import LLM
    from deltaserve.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = LLM(model=str(checkpoint()), quantization=fmt, num_threads=threads, max_num_seqs=1,
                 max_model_len=prompt + 16, max_num_batched_tokens=prompt, kv_cache_memory=1 << 30,
                 enable_prefix_caching=False).engine
    assert engine.executor.name == "fused-cpu", engine.executor.name
    clock = time.thread_time if threads == 1 else time.perf_counter

    def prefill(salt: int) -> float:
        ids = [(7 * i + salt) % 240000 + 10 for i in range(prompt)]
        engine.add_request(f"r{salt}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = clock()
        while engine.has_unfinished_requests():
            engine.step()
        return clock() - start

    prefill(0)  # warm-up
    new = old = float("inf")
    for r in range(rounds):
        use_kernel(ext, kernel, True)
        new = min(new, prefill(2 * r + 1))
        use_kernel(ext, kernel, False)
        old = min(old, prefill(2 * r + 2))
    use_kernel(ext, kernel, True)
    print(f"prefill {fmt} {prompt} tokens threads {threads}: {kernel} {prompt / new:6.1f} tok/s  old "
          f"{prompt / old:6.1f} tok/s  old/{kernel} x{old / new:5.2f} ({'CPU' if threads == 1 else 'wall'} time)",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                        default=["linear_attn.in_proj", "mlp.gate_up_proj", "mlp.down_proj"])
    parser.add_argument("--formats", nargs="+", choices=["int8", "int4"], default=["int8", "int4"])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two paths")
    parser.add_argument("--bf16", action="store_true", help="torch's bf16 matmul against the packed fp32 kernel")
    parser.add_argument("--prefill", choices=["int8", "int4"], help="the engine's prefill at the 0.8B shape")
    parser.add_argument("--kernel", choices=["amx", "vnni"], help="the tile kernel (default: amx where it runs)")
    args = parser.parse_args(argv)
    from deltaserve.ops.fused_ext import load_extension

    ext = load_extension()
    if args.bf16:
        run_bf16(ext, args.shapes, args.rows, args.threads, args.rounds)
        return
    kernel = args.kernel or ("amx" if ext.amx_supported() else "vnni")
    if kernel == "amx" and not ext.amx_supported():
        raise SystemExit(f"no AMX-INT8 here: {ext.amx_status()}")
    if kernel == "vnni" and not ext.vnni_tiles_supported():
        raise SystemExit("no VNNI tiles in this build (AVX512-VNNI)")
    if args.prefill:
        for threads in args.threads:
            for prompt in args.rows:
                run_prefill(ext, kernel, args.prefill, prompt, threads, min(args.rounds, 2))
        return
    ext.set_amx_rows(1)
    ext.set_vnni_tile_rows(1)
    run_int8(ext, kernel, args.shapes, args.formats, args.rows, args.threads, args.rounds)


if __name__ == "__main__":
    main()
