"""Prefix caching on and off, one thread unless --threads (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_prefix.py [--model DIR] [--rounds 3] [--shared 64] [--max-num-seqs 64]
        [--kv-cache-memory GiB] [--threads 1] [--max-tokens 32] [--skip-no-reuse] [--no-reuse-requests 32]
        [--only-no-reuse] [--one-engine-at-a-time] [--section HEADING] [--no-write]

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


@dataclass(slots=True)
class RoundResult:
    """One engine's measurements in one round; outputs are kept to check the two engines agree."""

    ttft: list[float]  # s per chat turn
    shared_cpu_s: float
    reused: int  # prompt tokens the shared-prefix requests reused
    no_reuse_cpu_s: list[float]  # per no-reuse workload
    outputs: list


def no_reuse_workloads(vocab: int, out: SamplingParams, seed: int, n: int = 32) -> list:
    """(c): fresh prompts every round, so a cached engine never hits: n long prompts, then 2n mixed requests."""
    rng = random.Random(100 + seed)
    return [
        ([tokens(rng, 1000, vocab) for _ in range(n)], out),
        ([tokens(rng, rng.randint(16, 256), vocab) for _ in range(2 * n)],
         [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 256), ignore_eos=True) for _ in range(2 * n)]),
    ]


def no_reuse_labels(n: int) -> list[str]:
    return [f"no reuse: {n} distinct 1,000-token prompts, at once",
            f"no reuse: {2 * n} requests, prompts and outputs 16..256 tokens, at once"]


def run_round(llm: LLM, vocab: int, out: SamplingParams, r: int, shared_n: int, no_reuse: int,
              chat: bool = True) -> RoundResult:
    """no_reuse: the n of no_reuse_workloads (0: skip them); chat False skips (a)."""
    ttft, chat_outs = chat_ttft(llm, vocab, out, seed=1 + r) if chat else ([], [])  # (a) a new one each round
    rng = random.Random(200 + r)  # (b) a new prefix each round
    prefix = tokens(rng, 1000, vocab)
    before = llm.engine.stats().prefix_cache
    shared_s, shared_outs = batch(llm, [prefix + tokens(rng, 24, vocab) for _ in range(shared_n)], out)
    after = llm.engine.stats().prefix_cache
    reused = 0 if after is None else after.hits - before.hits
    costs, cost_outs = [], []
    for prompts, params in no_reuse_workloads(vocab, out, r, no_reuse) if no_reuse else ():
        t, o = batch(llm, prompts, params)
        costs.append(t)
        cost_outs.append(o)
    return RoundResult(ttft, shared_s, reused, costs, [chat_outs, shared_outs, cost_outs])


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
    ap.add_argument("--no-reuse-requests", type=int, default=32,
                    help="(c)'s size: this many 1,000-token prompts, then twice as many mixed requests")
    ap.add_argument("--only-no-reuse", action="store_true", help="run (c) alone (no chat, no shared prefix)")
    ap.add_argument("--one-engine-at-a-time", action="store_true",
                    help="build each engine afresh for its turn of a round and drop it after (for a checkpoint "
                    "two engines of which do not fit in memory together)")
    ap.add_argument("--section", default=SECTION, help="the docs/benchmarks.md heading to write under")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    setup = Setup(args.model, args.max_num_seqs, int(args.kv_cache_memory * (1 << 30)), args.threads, out)
    kept: dict[bool, LLM] = {}

    def ready(caching: bool) -> LLM:
        if caching in kept:
            return kept[caching]
        if args.one_engine_at_a_time:
            kept.clear()
            gc.collect()
        llm = engine(setup, caching)
        vocab = llm.engine.model_config.vocab_size  # warm-up: first calls allocate and build
        llm.generate([{"prompt_token_ids": tokens(random.Random(9), 300, vocab)}], out, use_tqdm=False)
        kept[caching] = llm
        return llm

    lines = [f"Checkpoint {args.model or 'demo'}; {machine()}; {datetime.date.today()}; {args.threads} thread(s); "
             f"max_num_seqs {args.max_num_seqs}, {args.kv_cache_memory:g} GiB of cache memory per engine; "
             f"{args.max_tokens} tokens out per request.", ""]
    # Each round runs both engines in turn, back to back, so the speedup of a round is measured under one load.
    rounds: list[tuple[RoundResult, RoundResult]] = []
    for r in range(args.rounds):
        results = []
        for caching in (False, True):
            llm = ready(caching)
            vocab = llm.engine.model_config.vocab_size
            results.append(run_round(llm, vocab, out, r, 0 if args.only_no_reuse else args.shared,
                                     0 if args.skip_no_reuse else args.no_reuse_requests, not args.only_no_reuse))
            del llm  # with --one-engine-at-a-time only `kept` holds it, so the next build can drop it first
        p, c = results
        assert p.outputs == c.outputs, "outputs differ with prefix caching"
        rounds.append((p, c))
        print(f"round {r + 1}: chat TTFT no caching {ratios([x * 1e3 for x in p.ttft])} ms, caching "
              f"{ratios([x * 1e3 for x in c.ttft])} ms; shared prefix {p.shared_cpu_s:.2f} / {c.shared_cpu_s:.2f} "
              f"CPU s", flush=True)  # progress: a long run shows what it has
    cached = kept.get(True) or ready(True)
    usage = cached.engine.cache.usage()
    snaps = cached.engine.cache.prefix.snapshots

    def best(pick) -> tuple[float, float]:
        return min(pick(p) for p, _ in rounds), min(pick(c) for _, c in rounds)

    chat_lines = [f"8-turn chat behind a 1,000-token system prompt (each turn + 40 tokens, the answer re-sent): "
                  f"time to first token per turn (ms, wall clock, best of {args.rounds} interleaved rounds; "
                  "speedup of each round)", "",
                  "| turn | prompt tokens | no caching | caching | speedup per round |", "|---|---|---|---|---|"]
    n = 1000
    for i in range(len(rounds[0][0].ttft)):
        n += 40
        a, b = best(lambda x, i=i: x.ttft[i])
        chat_lines.append(f"| {i + 1} | {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | "
                          f"{ratios([p.ttft[i] / c.ttft[i] for p, c in rounds])}x |")
        n += args.max_tokens
    a, b = best(lambda x: x.shared_cpu_s)
    lines += chat_lines + [""] if not args.only_no_reuse else []
    lines += ["| workload | no caching | caching | speedup per round |", "|---|---|---|---|"]
    if not args.only_no_reuse:
        lines.append(f"| {args.shared} requests sharing a 1,000-token prefix (+24 own, {args.max_tokens} out), at "
                     f"once: CPU s (best of {args.rounds}) | {a:.2f} | {b:.2f} | "
                     f"{' / '.join(f'{p.shared_cpu_s / c.shared_cpu_s:.2f}' for p, c in rounds)}x |")
    costs: list[str] = []
    for w, label in enumerate(no_reuse_labels(args.no_reuse_requests) if not args.skip_no_reuse else []):
        a, b = best(lambda x, w=w: x.no_reuse_cpu_s[w])
        per = " / ".join(f"{100 * (c.no_reuse_cpu_s[w] / p.no_reuse_cpu_s[w] - 1):+.1f}%" for p, c in rounds)
        lines.append(f"| {label}: CPU s (best of {args.rounds}) | {a:.2f} | {b:.2f} | {per} time |")
        costs.append(f"{100 * (b / a - 1):+.1f}%")
    lines.append("")
    if not args.only_no_reuse:
        lines.append(f"The last round's {args.shared} shared-prefix requests reused {rounds[-1][1].reused:,} of "
                     f"{args.shared * 1024:,} prompt tokens. Snapshot pool at the end: {usage.used_snapshots} of "
                     f"{usage.total_snapshots} snapshots, {format_bytes(usage.snapshot_bytes)} "
                     f"({format_bytes(snaps.bytes_per_snapshot)} each; the pool's budget "
                     f"{format_bytes(snaps.num_total * snaps.bytes_per_snapshot)}); KV blocks cached "
                     f"{usage.cached_blocks:,} of {usage.total_blocks:,}.")
    if costs:
        lines += ["", f"Cost where nothing is reused (best of the rounds): {', '.join(costs)} CPU time (the step "
                  "hook, snapshot copies at prompt points and decode block boundaries, prompt chunks cut at "
                  "snapshot points); the rule for turning caching on by default is within 2%."]
    text = args.section + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section(args.section, text)


if __name__ == "__main__":
    main()
