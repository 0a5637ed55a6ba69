"""Per-token cost of JSON-schema constrained decoding against unconstrained decoding, on the demo, at
batch 1 and 32 (not a test; timing decides nothing). One thread unless --threads.

    .venv/bin/python benchmarks/bench_structured.py [--batches 1 32] [--tokens 64] [--threads 1]

Both runs are greedy and generate --tokens tokens per request (the schema's minItems keeps the constrained
output going that long; the plain run ignores EOS). The constrained run pays for everything structured
outputs add: syncing each row's matcher and computing its mask (on a worker thread, during the forward),
checking each argmax against it, and the logits and masked argmax of the rows it refuses. Target: <= 10%
per token at batch 32.

The machine is shared and its load swings: the runs alternate, the fastest of each counts, and the
process CPU time per token-step (all threads, the mask worker's included) is reported beside the wall
time. CPU time is the steadier number under load; wall time shows what the overlap hides."""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve import LLM, SamplingParams, StructuredOutputsParams

# Long enough for any --tokens: 200 strings at least.
SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 200}


def run(llm: LLM, batch: int, tokens: int, structured: bool) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, tokens generated)"""
    so = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=not structured, structured_outputs=so)
    prompts = [f"List {i} things you see in the city:" for i in range(batch)]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return elapsed, cpu, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the two runs; the fastest of each counts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=max(args.batches))
    run(llm, 2, 8, True)  # warm-up: the fused step, llguidance's token trie
    print(f"{'batch':>5} {'ms/token-step wall: plain':>26} {'json':>6} {'overhead':>9}"
          f" {'CPU: plain':>11} {'json':>6} {'overhead':>9}")
    for b in args.batches:
        best = {False: [float("inf")] * 2, True: [float("inf")] * 2}  # [wall, cpu] ms per token-step
        for _ in range(args.rounds):  # the machine is shared: alternate, and keep the fastest of each
            for structured in (False, True):
                seconds, cpu, n = run(llm, b, args.tokens, structured)
                steps = n / b  # every request advances one token per step
                best[structured] = [min(best[structured][0], seconds / steps * 1e3),
                                    min(best[structured][1], cpu / steps * 1e3)]
        (pw, pc), (jw, jc) = best[False], best[True]
        print(f"{b:>5} {pw:>26.2f} {jw:>6.2f} {100 * (jw / pw - 1):>8.1f}%"
              f" {pc:>11.2f} {jc:>6.2f} {100 * (jc / pc - 1):>8.1f}%")


if __name__ == "__main__":
    main()
