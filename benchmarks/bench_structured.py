"""Per-token cost of JSON-schema constrained decoding against unconstrained decoding, on the demo, at
batch 1 and 32 (not a test; timing decides nothing). One thread unless --threads.

    .venv/bin/python benchmarks/bench_structured.py [--batches 1 32] [--tokens 64] [--threads 1]

Both runs are greedy and generate --tokens tokens per request (the schema's minItems keeps the constrained
output going that long; the plain run ignores EOS). The constrained run pays for everything structured
outputs add: the logits of every row (the plain all-greedy batch takes its argmax inside the lm_head),
llguidance's mask per row, and applying it. Target: <= 10% per token at batch 32."""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve import LLM, SamplingParams, StructuredOutputsParams

# Long enough for any --tokens: 200 strings at least.
SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 200}


def run(llm: LLM, batch: int, tokens: int, structured: bool) -> tuple[float, int]:
    so = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=not structured, structured_outputs=so)
    prompts = [f"List {i} things you see in the city:" for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


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
    print(f"{'batch':>5} {'plain ms/token-step':>20} {'json ms/token-step':>19} {'overhead':>9}")
    for b in args.batches:
        plain = constrained = float("inf")
        for _ in range(args.rounds):  # the machine is shared: alternate, and keep the fastest of each
            for structured in (False, True):
                seconds, n = run(llm, b, args.tokens, structured)
                per_step = seconds / (n / b) * 1e3  # every request advances one token per step
                if structured:
                    constrained = min(constrained, per_step)
                else:
                    plain = min(plain, per_step)
        print(f"{b:>5} {plain:>20.2f} {constrained:>19.2f} {100 * (constrained / plain - 1):>8.1f}%")


if __name__ == "__main__":
    main()
