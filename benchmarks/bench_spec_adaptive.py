"""Speculation off, fixed k = 1..3 and adaptive k, taking turns in one process (not a test; timing decides
nothing). It decides whether speculation should be on by default for checkpoints with an MTP head.

    .venv/bin/python benchmarks/bench_spec_adaptive.py [--model DIR ...] [--rounds 3] [--threads 1]

Every configuration is one engine, built once and kept (so the adaptive one keeps what it measured, as a
server would). Each round runs every engine on the same workload in a fresh random order: batch 1 (the
prompts one at a time) and batch 8 (all together), greedy, ignore_eos, `--tokens` new tokens each. The
figure is decode CPU seconds per generated token (the process's CPU time, one compute thread, from the
step in which every request has its first token to the end): other jobs on a shared machine stretch wall
time far more than the work done. `--clock wall` takes wall time instead, for an idle machine and for more
than one thread (CPU time counts the threads' waiting too); `--quantization` runs every engine in that
weight format. Each round gives each configuration its ratio to plain decoding of that
same round; the table shows the median ratio over rounds (above 1: faster than plain) and the median
tokens per CPU second. Greedy outputs are checked identical to plain decoding. The table goes into
docs/benchmarks.md under "MTP speculative decoding: adaptive k and the default"."""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_spec import PROMPTS  # noqa: E402
from report import machine, write_section  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

SECTION = "## MTP speculative decoding: adaptive k and the default"
CONFIGS: dict[str, dict | None] = {
    "off": None,
    "k=1": {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False},
    "k=2": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False},
    "k=3": {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
    "k=4": {"method": "mtp", "num_speculative_tokens": 4, "adaptive": False},
    "adaptive (max 3)": {"method": "mtp", "num_speculative_tokens": 3},
}


def decode(llm: LLM, batch: int, tokens: int) -> tuple[float, float, list[list[int]]]:
    """(CPU seconds, wall seconds, outputs) of the decode phase: batch 1 runs each prompt alone."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    groups = [[p] for p in PROMPTS] if batch == 1 else [(PROMPTS * (batch // len(PROMPTS) + 1))[:batch]]
    cpu = wall = 0.0
    outputs: list[list[int]] = []
    for group in groups:
        for i, p in enumerate(group):
            engine.add_request(f"b{i}", p, params)
        started = None
        while engine.has_unfinished_requests():
            for o in engine.step(finished_only=True):
                outputs.append(o.outputs[0].token_ids)
            if started is None and all(r.output_token_ids for r in engine.requests.values()):
                started = time.process_time(), time.perf_counter()
        cpu += time.process_time() - started[0]
        wall += time.perf_counter() - started[1]
    return cpu, wall, outputs


def measure(model: str | None, rounds: int, tokens: int, batches: list[int], clock: str = "cpu",
            quantization: str | None = None) -> dict:
    llms = {name: LLM(model=model, max_model_len=512, max_num_seqs=8, speculative_config=spec,
                      quantization=quantization)
            for name, spec in CONFIGS.items()}
    # One untimed round of every batch size first: the adaptive engine learns its step and draft costs at a
    # batch size the first time it runs it (it tries drafting there, one-off costs a running server has paid),
    # and the rounds measure the engine after that. The learning round's speeds are printed, not tabled.
    for batch in batches:
        for name, llm in llms.items():
            _, wall, outs = decode(llm, batch, tokens)
            print(f"warm-up batch {batch} {name}: {len(outs) * tokens / wall:.1f} tok/s wall", flush=True)
    ratios: dict[tuple[int, str], list[float]] = {}
    rates: dict[tuple[int, str], list[float]] = {}
    drafted: dict[tuple[int, str], list[int]] = {}  # (verifies, draft tokens, accepted) over all rounds
    rng = random.Random(0)
    for r in range(rounds):
        for batch in batches:
            order = list(llms)
            rng.shuffle(order)
            per_token, outs = {}, {}
            for name in order:
                before = llms[name].engine.stats().spec
                cpu, wall, outs[name] = decode(llms[name], batch, tokens)
                if before is not None:
                    s = llms[name].engine.stats().spec
                    counts = drafted.setdefault((batch, name), [0, 0, 0])
                    counts[0] += s.num_drafts - before.num_drafts
                    counts[1] += s.num_draft_tokens - before.num_draft_tokens
                    counts[2] += s.num_accepted_tokens - before.num_accepted_tokens
                n = len(outs[name]) * tokens
                per_token[name] = (cpu if clock == "cpu" else wall) / n
                print(f"round {r} batch {batch} {name}: {n / cpu:.1f} tok/CPU-s, {n / wall:.1f} tok/s wall",
                      flush=True)
            for name in order:
                if sorted(outs[name]) != sorted(outs["off"]):
                    raise SystemExit(f"{name} at batch {batch}: greedy output differs from plain decoding")
                ratios.setdefault((batch, name), []).append(per_token["off"] / per_token[name])
                rates.setdefault((batch, name), []).append(1 / per_token[name])
    return {"ratios": ratios, "rates": rates, "drafted": drafted}


def render(results: dict[str, dict], rounds: int, threads: int, tokens: int, clock: str = "cpu",
           quantization: str | None = None) -> str:
    per = "CPU" if clock == "cpu" else "wall"
    lines = [
        SECTION, "",
        f"Run {datetime.date.today().isoformat()} on {machine()}; `num_threads={threads}`; weights "
        f"{quantization or 'as stored'}, fp32 compute; greedy, "
        f"ignore_eos, {tokens} new tokens per request ({len(PROMPTS)} prompts: batch 1 runs them one at a "
        f"time, batch 8 together); {rounds} rounds, each running every configuration once in a random order. "
        f"Speed-up: plain decoding's decode {per} seconds per token over the configuration's, in the same "
        "round, median over rounds (above 1 is faster). Greedy outputs identical to plain decoding in every "
        "run. Produced by `benchmarks/bench_spec_adaptive.py`.", "",
        f"| checkpoint | batch | configuration | speed-up (median, min-max) | tok per {per}-s | "
        "acceptance rate | drafts per verify |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, res in results.items():
        cells = sorted(res["ratios"].items(), key=lambda kv: (kv[0][0], list(CONFIGS).index(kv[0][1])))
        for (batch, name), rs in cells:
            verifies, draft_tokens, accepted = res["drafted"].get((batch, name), (0, 0, 0))
            acc = f"{accepted / draft_tokens:.2f}" if draft_tokens else "-"
            per = f"{draft_tokens / verifies:.2f}" if verifies else "-"
            lines.append(
                f"| {label} | {batch} | {name} | {statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f}) | "
                f"{statistics.median(res['rates'][batch, name]):.0f} | {acc} | {per} |"
            )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None,
                    help="checkpoint directory with an MTP head; repeat for several ('demo': the embedded one)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="time per token: the process's CPU time (a shared machine) or wall time (an idle one; "
                         "the measure at more than one thread, where CPU time also counts waiting threads)")
    ap.add_argument("--quantization", default=None, help="a weight format for every engine (int8, int4, fp8)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # the engine keeps what the process set (engine/threads.py)
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    for model in args.model or ["demo"]:
        label = "embedded demo" if model == "demo" else Path(model).name
        results[label] = measure(None if model == "demo" else model, args.rounds, args.tokens, batches,
                                 args.clock, args.quantization)
    text = render(results, args.rounds, args.threads, args.tokens, args.clock, args.quantization)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
