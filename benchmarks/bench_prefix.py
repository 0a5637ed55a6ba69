"""Prefix caching on and off, one thread (not a test; timing decides nothing).

    .venv/bin/python benchmarks/bench_prefix.py [--model DIR] [--rounds 3] [--no-write]

Workloads, each run on an engine without and one with --enable-prefix-caching (default settings):
(a) an 8-turn chat behind a 1,000-token system prompt: every turn re-sends the conversation plus a
    40-token message and gets 32 tokens back; time to first token per turn;
(b) 64 requests sharing a 1,000-token prefix (each + 24 tokens of its own, 32 tokens out), all at once;
(c) the cost where nothing is reused: 32 distinct 1,000-token prompts, 32 tokens out, all at once, and
    64 requests with prompts and outputs of 16..256 tokens (fresh prompts every round, so the cached
    engine never hits).
Outputs of the two engines are checked equal. The table goes into docs/benchmarks.md under
"Prefix caching" (that section is replaced, others are kept)."""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import machine, write_section  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.cli_plan import format_bytes  # noqa: E402

SECTION = "## Prefix caching"
OUT = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def engine(model: str | None, caching: bool) -> LLM:
    return LLM(model=model, max_model_len=4096, max_num_seqs=64, kv_cache_memory=1 << 30,
               enable_prefix_caching=caching)  # default settings otherwise (block 16, mamba_block_size 512)


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def chat_ttft(llm: LLM, vocab: int, turns: int = 8) -> tuple[list[float], list[list[int]]]:
    rng = random.Random(1)
    prompt = tokens(rng, 1000, vocab)
    ttft, outs = [], []
    for _ in range(turns):
        prompt += tokens(rng, 40, vocab)
        out = llm.generate([{"prompt_token_ids": prompt}], OUT, use_tqdm=False)[0]
        ttft.append(out.metrics.time_to_first_token)
        outs.append(out.outputs[0].token_ids)
        prompt += out.outputs[0].token_ids
    return ttft, outs


def batch(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = OUT
          ) -> tuple[float, list[list[int]]]:
    """CPU seconds of the process (one thread: the engine's work, and less skewed than wall time by the
    other jobs of a shared machine) and the outputs."""
    gc.collect()
    t = time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.process_time() - t, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plain, cached = engine(args.model, False), engine(args.model, True)
    vocab = plain.engine.model_config.vocab_size
    name = args.model or "demo"
    for llm in (plain, cached):  # warm-up: first calls allocate and build
        llm.generate([{"prompt_token_ids": tokens(random.Random(9), 300, vocab)}], OUT, use_tqdm=False)

    lines = [f"Checkpoint {name}; {machine()}; {datetime.date.today()}; 1 thread.", ""]
    # (a) per turn the best of `rounds` conversations, each on fresh engines (a cached engine that saw the
    # conversation would hit its first turn too)
    t_plain = t_cached = None
    for r in range(args.rounds):
        p, c = (plain, cached) if r == 0 else (engine(args.model, False), engine(args.model, True))
        tp, o_plain = chat_ttft(p, vocab)
        tc, o_cached = chat_ttft(c, vocab)
        assert o_plain == o_cached, "outputs differ with prefix caching"
        t_plain = tp if t_plain is None else [min(a, b) for a, b in zip(t_plain, tp, strict=True)]
        t_cached = tc if t_cached is None else [min(a, b) for a, b in zip(t_cached, tc, strict=True)]
    lines += [f"8-turn chat behind a 1,000-token system prompt: time to first token per turn (ms, wall clock, best "
              f"of {args.rounds} conversations)", "",
              "| turn | prompt tokens | no caching | caching | speedup |", "|---|---|---|---|---|"]
    n = 1000
    for i, (a, b) in enumerate(zip(t_plain, t_cached, strict=True)):
        n += 40
        lines.append(f"| {i + 1} | {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.1f}x |")
        n += 32
    # (b)
    rng = random.Random(2)
    prefix = tokens(rng, 1000, vocab)
    shared = [prefix + tokens(rng, 24, vocab) for _ in range(64)]
    s_plain, so_plain = batch(plain, shared)
    before = cached.engine.stats().prefix_cache.hits
    s_cached, so_cached = batch(cached, shared)
    hits = cached.engine.stats().prefix_cache.hits - before
    assert so_plain == so_cached, "outputs differ with prefix caching"
    usage = cached.engine.cache.usage()
    each = format_bytes(cached.engine.cache.prefix.snapshots.bytes_per_snapshot)
    lines += ["", "| workload | no caching | caching | speedup |", "|---|---|---|---|",
              f"| 64 requests sharing a 1,000-token prefix (+24 own, 32 out), at once: CPU s | {s_plain:.2f} | "
              f"{s_cached:.2f} | {s_plain / s_cached:.2f}x |"]
    # (c) best of rounds, the two engines in turn, fresh prompts every round
    costs: list[float] = []  # % more CPU time with caching where nothing is reused
    for label, make in (
        ("no reuse: 32 distinct 1,000-token prompts (32 out), at once", lambda rng: (
            [tokens(rng, 1000, vocab) for _ in range(32)], OUT)),
        ("no reuse: 64 requests, prompts and outputs 16..256 tokens, at once", lambda rng: (
            [tokens(rng, rng.randint(16, 256), vocab) for _ in range(64)],
            [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 256), ignore_eos=True) for _ in range(64)])),
    ):
        best_plain = best_cached = float("inf")
        for r in range(args.rounds):
            prompts, params = make(random.Random(100 + r))
            tp, op = batch(plain, prompts, params)
            tc, oc = batch(cached, prompts, params)
            assert op == oc, "outputs differ with prefix caching"
            best_plain, best_cached = min(best_plain, tp), min(best_cached, tc)
        lines.append(f"| {label}: CPU s (best of {args.rounds}) | {best_plain:.2f} | {best_cached:.2f} | "
                     f"{best_plain / best_cached:.3f}x |")
        costs.append(100 * (best_cached / best_plain - 1))
    lines += ["", f"The 64 shared-prefix requests reused {hits:,} of {64 * 1024:,} prompt tokens. Snapshot pool "
              f"at the end: {usage.used_snapshots} of {usage.total_snapshots} snapshots, "
              f"{format_bytes(usage.snapshot_bytes)} ({each} each); KV blocks cached {usage.cached_blocks:,} "
              f"of {usage.total_blocks:,}.",
              "", f"Cost where nothing is reused: {', '.join(f'{c:+.1f}%' for c in costs)} CPU time (the step hook "
              "and snapshot copies, and prompt chunks cut at snapshot points); the rule for turning caching on by "
              "default is within 2%."]
    text = SECTION + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
