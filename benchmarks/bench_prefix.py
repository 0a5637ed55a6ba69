"""Prefix caching on and off, one thread unless --threads (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_prefix.py [--model DIR] [--rounds 3] [--shared 64] [--max-num-seqs 64]
        [--kv-cache-memory GiB] [--threads 1] [--max-tokens 32] [--skip-no-reuse] [--section HEADING] [--no-write]

Workloads, each run on an engine without and one with --enable-prefix-caching (default settings):
(a) an 8-turn chat behind a 1,000-token system prompt: every turn re-sends the conversation (the previous
    answer's token ids included) plus a 40-token message and gets 32 tokens back; time to first token per turn;
(b) 64 requests sharing a 1,000-token prefix (each + 24 tokens of its own, 32 tokens out), all at once;
(c) the cost where nothing is reused: 32 distinct 1,000-token prompts, 32 tokens out, all at once, and
    64 requests with prompts and outputs of 16..256 tokens (fresh prompts every round, so the cached
    engine never hits).
The two engines run in turn within each round (a new conversation / prefix / prompts per round), so the
speedups of a round are measured under the same load. Outputs of the two engines are checked equal. The
table goes into docs/benchmarks.md under "Prefix caching", or --section (that section is replaced, others
are kept)."""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import machine, write_section  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.cli_plan import format_bytes  # noqa: E402

SECTION = "## Prefix caching"


@dataclass(slots=True)
class Setup:
    model: str | None
    max_num_seqs: int
    kv_cache_memory: int  # bytes
    threads: int
    out: SamplingParams


def engine(setup: Setup, caching: bool) -> LLM:
    return LLM(model=setup.model, max_model_len=4096, max_num_seqs=setup.max_num_seqs,
               kv_cache_memory=setup.kv_cache_memory, num_threads=setup.threads,
               enable_prefix_caching=caching)  # default settings otherwise (block 16, mamba_block_size 512)


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def chat_ttft(llm: LLM, vocab: int, out: SamplingParams, seed: int, turns: int = 8
              ) -> tuple[list[float], list[list[int]]]:
    """A conversation of its own per seed (so a cached engine that ran other seeds has nothing of it): every
    turn re-sends the conversation, the previous answer's token ids included, plus a 40-token message."""
    rng = random.Random(seed)
    prompt = tokens(rng, 1000, vocab)
    ttft, outs = [], []
    for _ in range(turns):
        prompt += tokens(rng, 40, vocab)
        res = llm.generate([{"prompt_token_ids": prompt}], out, use_tqdm=False)[0]
        ttft.append(res.metrics.time_to_first_token)
        outs.append(res.outputs[0].token_ids)
        prompt += res.outputs[0].token_ids
    return ttft, outs


def batch(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
          ) -> tuple[float, list[list[int]]]:
    """CPU seconds of the process (the engine's work, and less skewed than wall time by the other jobs of a
    shared machine) and the outputs."""
    gc.collect()
    t = time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.process_time() - t, [o.outputs[0].token_ids for o in outs]


def ratios(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (no caching, then caching)")
    ap.add_argument("--shared", type=int, default=64, help="requests sharing the 1,000-token prefix")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB of cache memory per engine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--skip-no-reuse", action="store_true", help="skip (c), the cost where nothing is reused")
    ap.add_argument("--section", default=SECTION, help="the docs/benchmarks.md heading to write under")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    setup = Setup(args.model, args.max_num_seqs, int(args.kv_cache_memory * (1 << 30)), args.threads, out)
    plain, cached = engine(setup, False), engine(setup, True)
    vocab = plain.engine.model_config.vocab_size
    name = args.model or "demo"
    for llm in (plain, cached):  # warm-up: first calls allocate and build
        llm.generate([{"prompt_token_ids": tokens(random.Random(9), 300, vocab)}], out, use_tqdm=False)

    lines = [f"Checkpoint {name}; {machine()}; {datetime.date.today()}; {args.threads} thread(s); max_num_seqs "
             f"{args.max_num_seqs}, {args.kv_cache_memory:g} GiB of cache memory per engine; {args.max_tokens} "
             f"tokens out per request.", ""]
    # (a) each round a new conversation on both engines in turn; per turn the best time of the rounds and
    # the speedup of every round (the two runs of a round are back to back, so they share the load)
    t_plain = t_cached = None
    per_round: list[list[float]] = []
    for r in range(args.rounds):
        tp, o_plain = chat_ttft(plain, vocab, out, seed=1 + r)
        tc, o_cached = chat_ttft(cached, vocab, out, seed=1 + r)
        assert o_plain == o_cached, "outputs differ with prefix caching"
        per_round.append([a / b for a, b in zip(tp, tc, strict=True)])
        print(f"chat round {r + 1}: no caching {ratios([x * 1e3 for x in tp])} ms, caching "
              f"{ratios([x * 1e3 for x in tc])} ms", flush=True)  # progress: a long run shows what it has
        t_plain = tp if t_plain is None else [min(a, b) for a, b in zip(t_plain, tp, strict=True)]
        t_cached = tc if t_cached is None else [min(a, b) for a, b in zip(t_cached, tc, strict=True)]
    lines += [f"8-turn chat behind a 1,000-token system prompt (each turn + 40 tokens, the answer re-sent): time "
              f"to first token per turn (ms, wall clock, best of {args.rounds} interleaved rounds; speedup of "
              "each round)", "",
              "| turn | prompt tokens | no caching | caching | speedup per round |", "|---|---|---|---|---|"]
    n = 1000
    for i, (a, b) in enumerate(zip(t_plain, t_cached, strict=True)):
        n += 40
        lines.append(f"| {i + 1} | {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | "
                     f"{ratios([rr[i] for rr in per_round])}x |")
        n += args.max_tokens
    # (b) interleaved rounds, a new prefix each round
    s_plain, s_cached, speedups, hits = float("inf"), float("inf"), [], 0
    for r in range(args.rounds):
        rng = random.Random(200 + r)
        prefix = tokens(rng, 1000, vocab)
        shared = [prefix + tokens(rng, 24, vocab) for _ in range(args.shared)]
        tp, so_plain = batch(plain, shared, out)
        before = cached.engine.stats().prefix_cache.hits
        tc, so_cached = batch(cached, shared, out)
        hits = cached.engine.stats().prefix_cache.hits - before
        assert so_plain == so_cached, "outputs differ with prefix caching"
        s_plain, s_cached = min(s_plain, tp), min(s_cached, tc)
        speedups.append(tp / tc)
        print(f"shared prefix round {r + 1}: {tp:.2f} / {tc:.2f} CPU s, {hits} tokens reused", flush=True)
    usage = cached.engine.cache.usage()
    snaps = cached.engine.cache.prefix.snapshots
    lines += ["", "| workload | no caching | caching | speedup per round |", "|---|---|---|---|",
              f"| {args.shared} requests sharing a 1,000-token prefix (+24 own, {args.max_tokens} out), at once: "
              f"CPU s (best of {args.rounds}) | {s_plain:.2f} | {s_cached:.2f} | "
              f"{' / '.join(f'{x:.2f}' for x in speedups)}x |"]
    # (c) best of rounds, the two engines in turn, fresh prompts every round
    costs: list[str] = []  # more CPU time with caching where nothing is reused, per round
    workloads = () if args.skip_no_reuse else (
        ("no reuse: 32 distinct 1,000-token prompts, at once", lambda rng: (
            [tokens(rng, 1000, vocab) for _ in range(32)], out)),
        ("no reuse: 64 requests, prompts and outputs 16..256 tokens, at once", lambda rng: (
            [tokens(rng, rng.randint(16, 256), vocab) for _ in range(64)],
            [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 256), ignore_eos=True) for _ in range(64)])),
    )
    for label, make in workloads:
        best_plain = best_cached = float("inf")
        cost = []
        for r in range(args.rounds):
            prompts, params = make(random.Random(100 + r))
            tp, op = batch(plain, prompts, params)
            tc, oc = batch(cached, prompts, params)
            assert op == oc, "outputs differ with prefix caching"
            best_plain, best_cached = min(best_plain, tp), min(best_cached, tc)
            cost.append(100 * (tc / tp - 1))
        lines.append(f"| {label}: CPU s (best of {args.rounds}) | {best_plain:.2f} | {best_cached:.2f} | "
                     f"{' / '.join(f'{c:+.1f}%' for c in cost)} time |")
        costs.append(f"{100 * (best_cached / best_plain - 1):+.1f}%")
    lines += ["", f"The last round's {args.shared} shared-prefix requests reused {hits:,} of "
              f"{args.shared * 1024:,} prompt tokens. Snapshot pool at the end: {usage.used_snapshots} of "
              f"{usage.total_snapshots} snapshots, {format_bytes(usage.snapshot_bytes)} "
              f"({format_bytes(snaps.bytes_per_snapshot)} each; the pool's budget "
              f"{format_bytes(snaps.num_total * snaps.bytes_per_snapshot)}); KV blocks cached "
              f"{usage.cached_blocks:,} of {usage.total_blocks:,}."]
    if costs:
        lines += ["", f"Cost where nothing is reused (best of the rounds): {', '.join(costs)} CPU time (the step hook, "
                  "snapshot copies at prompt points and decode block boundaries, prompt chunks cut at snapshot "
                  "points); the rule for turning caching on by default is within 2%."]
    text = args.section + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()
