"""Two checkouts of deltaserve on bench_engine's workloads, taking turns (not a test; timing decides nothing).

    .venv/bin/python benchmarks/ab_checkouts.py BEFORE_DIR AFTER_DIR [--rounds 3] [--threads 1]

Two versions of one package cannot share a process, so each round runs one worker process per checkout
(PYTHONPATH set to it, its own TORCH_EXTENSIONS_DIR), before and after alternating, and every cell keeps
the best of its rounds: a burst of load on this shared machine then hits both sides alike. Times are the
worker's CPU seconds (one compute thread), which load on the machine stretches far less than wall time
(it still shares the caches and memory bandwidth). Workloads, on
the embedded demo and bench_engine's ~60M random checkpoint (bf16 weights, fp32 compute): batch-1 decode
of 128 tokens, 64 requests of mixed lengths, and the prefill of a 2048-token prompt. Prints a Markdown
table with both columns and their ratio."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(model: str, threads: int) -> dict[str, float]:
    """One checkout's numbers (imported from PYTHONPATH): tok/s for the decodes, seconds for the prefill."""
    import torch

    from deltaserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    # Prefix caching off on both sides: a checkout before it had none, and bench_prefix measures its cost.
    llm = LLM(model=model, max_num_seqs=64, max_model_len=4096, max_num_batched_tokens=2048,
              kv_cache_memory=1 << 30, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    prompt = [(7 * i + 11) % vocab for i in range(16)]

    def seconds(fn) -> float:
        """CPU seconds of the process: with one compute thread (the engine steps on the calling thread),
        that is the work done, which other jobs on a shared machine do not stretch as they do wall time."""
        t = time.process_time()
        fn()
        return time.process_time() - t

    seconds(lambda: llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8),
                                 use_tqdm=False))
    decode = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    out = {"decode, batch 1 (tok/s)": 128 / seconds(
        lambda: llm.generate({"prompt_token_ids": prompt}, decode, use_tqdm=False))}
    rng = random.Random(0)  # bench_engine.workload_lengths(64), which this process must not import
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(16, 256))] for _ in range(64)]
    outs = [rng.randint(16, 256) for _ in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    out["64 requests (tok/s)"] = sum(outs) / seconds(
        lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    long = [(13 * i + 5) % vocab for i in range(2048)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out["prefill 2048 tokens (s)"] = seconds(
        lambda: llm.generate({"prompt_token_ids": long}, one, use_tqdm=False))
    return out


def run_worker(checkout: Path, model: str, threads: int, ext_dir: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout), TORCH_EXTENSIONS_DIR=str(ext_dir))
    cmd = [sys.executable, str(HERE / "ab_checkouts.py"), "--worker", model, "--threads", str(threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=checkout)
    if done.returncode:
        raise SystemExit(f"worker for {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path, nargs="?")
    ap.add_argument("after", type=Path, nargs="?")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.path.remove(str(HERE))  # deltaserve and everything else from the checkout on PYTHONPATH
        print(json.dumps(worker(args.worker, args.threads)))
        return
    sys.path.insert(0, str(HERE.parent))
    from bench_engine import build_random

    from deltaserve.assets import DEMO_DIR

    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo": str(DEMO_DIR), "random 60M": str(build_random(Path(tmp) / "random60m"))}
        sides = {"before": args.before.resolve(), "after": args.after.resolve()}
        ext = {name: Path(tmp) / f"ext-{name}" for name in sides}
        best: dict[tuple[str, str, str], float] = {}
        for r in range(args.rounds):
            for label, model in models.items():
                for side, checkout in sides.items():
                    for cell, value in run_worker(checkout, model, args.threads, ext[side]).items():
                        key = (label, cell, side)
                        lower_is_better = cell.endswith("(s)")
                        if key not in best or (value < best[key] if lower_is_better else value > best[key]):
                            best[key] = value
            print(f"round {r + 1} done", file=sys.stderr, flush=True)
    print(f"\n{args.threads} thread(s), best of {args.rounds} rounds, the checkouts taking turns\n")
    print("| checkpoint | workload | before | after | after / before |")
    print("|---|---|---|---|---|")
    for label in models:
        cells = list(dict.fromkeys(c for (m, c, _) in best if m == label))
        for cell in cells:
            b, a = best[label, cell, "before"], best[label, cell, "after"]
            print(f"| {label} | {cell} | {b:.3f} | {a:.3f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
