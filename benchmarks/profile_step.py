"""Where one engine step's time goes (not a test): decode steps at batch 1 and 32 and a mixed step (31
decodes + a 2000-token prompt chunk), split into the fused C++ forward (its projections, GDN conv and
recurrence, attention, and the rest: norms, activations, residuals), the lm_head logits, the sampler, and
the Python around them (scheduling, context building, detokenizing, bookkeeping).

    .venv/bin/python benchmarks/profile_step.py [--model DIR] [--threads 1] [--no-write]

The table goes into docs/benchmarks.md under "Where a step goes" (that section is replaced)."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import TimedCalls, machine, timed_into, write_section  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

SECTION = "## Where a step goes"
PARTS = ["projections", "gdn_conv_and_recurrence", "attention", "rest of the forward", "lm_head logits",
         "sampler", "Python: scheduling, context, detokenizing"]


def instrument(llm: LLM) -> dict[str, float]:
    """Wraps the runner's logits and sampler to time them; the fused step profiles itself. All-greedy
    batches take logits and argmax in one C++ call (LogitsHead.greedy_tokens), timed as the logits."""
    runner = llm.engine.runner
    spent: dict[str, float] = defaultdict(float)
    runner.head.compute_logits = timed_into(spent, "lm_head logits", runner.head.compute_logits)
    runner.head.greedy_tokens = timed_into(spent, "lm_head logits", runner.head.greedy_tokens)
    runner.sampler = TimedCalls(runner.sampler, spent, "sampler")
    return spent


def measure(llm: LLM, spent: dict[str, float], steps: int) -> dict[str, float]:
    """Mean milliseconds per step in each part over the next `steps` engine steps."""
    engine, fused = llm.engine, llm.engine.executor.trunk
    spent.clear()
    fused.profile()
    fused.set_profiling(True)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - t0
    fused.set_profiling(False)
    kernel = fused.profile()
    # The logits' projection is timed inside `projections` as well: take it out there.
    projections = kernel["projections"] - spent["lm_head logits"]
    forward = kernel["forward"]
    parts = {
        "projections": projections,
        "gdn_conv_and_recurrence": kernel["gdn_conv_and_recurrence"],
        "attention": kernel["attention"],
        "rest of the forward": forward - projections - kernel["gdn_conv_and_recurrence"] - kernel["attention"],
        "lm_head logits": spent["lm_head logits"],
        "sampler": spent["sampler"],
    }
    parts["Python: scheduling, context, detokenizing"] = total - sum(parts.values())
    return {k: 1e3 * v / steps for k, v in parts.items()} | {"total": 1e3 * total / steps}


def decode_case(llm: LLM, spent, batch: int, context: int, steps: int = 30) -> dict[str, float]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", {"prompt_token_ids": [(11 * i + 7 * j) % 5000 + 10
                                                                  for j in range(context)]}, params)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    result = measure(llm, spent, steps)
    for r in list(engine.requests):
        engine.abort_request(r)
    engine.step()
    return result


def mixed_case(llm: LLM, spent, rounds: int = 5) -> dict[str, float]:
    """31 requests decoding, then each round one new 2000-token prompt joins: that step is mixed."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(31):
        engine.add_request(f"m{i}", {"prompt_token_ids": [(13 * i + 3 * j) % 5000 + 10 for j in range(200)]},
                           params)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    for k in range(rounds):
        prompt = [(17 * k + 5 * j) % 5000 + 10 for j in range(2000)]
        engine.add_request(f"p{k}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
        for name, ms in measure(llm, spent, 1).items():
            totals[name] += ms / rounds
    for r in list(engine.requests):
        engine.abort_request(r)
    engine.step()
    return dict(totals)


def table(columns: dict[str, dict[str, float]], threads: int, model: str) -> str:
    lines = [
        SECTION,
        "",
        f"Run {datetime.date.today().isoformat()} on {machine()}; `torch.set_num_threads({threads})`; "
        f"checkpoint: {model}; fp32 compute; greedy. Mean milliseconds per engine step, measured with the "
        "fused step's own timers (`FusedTrunk.set_profiling`) and wall clocks around the lm_head and the "
        "sampler (all-greedy batches take their argmax inside the lm_head call, `FusedTrunk.greedy_tokens`, "
        "screened with bf16 dot products from two rows on, so their sampler row is 0); the Python row is "
        "the step's wall time minus everything above it. Produced by "
        "`benchmarks/profile_step.py`.",
        "",
        "| part | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for part in [*PARTS, "total"]:
        cells = []
        for col in columns.values():
            share = f" ({100 * col[part] / col['total']:.0f}%)" if part != "total" else ""
            cells.append(f"{col[part]:.3f}{share}")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, max_num_seqs=64, max_model_len=4096, max_num_batched_tokens=2048,
              kv_cache_memory=1 << 30)
    if llm.engine.executor.name != "fused-cpu":
        raise SystemExit("the fused step is not in use (enforce_eager, a non-fp32 model, or no compiler)")
    spent = instrument(llm)
    decode_case(llm, spent, 1, 16, steps=10)  # warm-up
    columns = {
        "decode, batch 1, context 16": decode_case(llm, spent, 1, 16, steps=100),
        "decode, batch 32, context 200": decode_case(llm, spent, 32, 200),
        "mixed: 31 decodes + 2000-token chunk": mixed_case(llm, spent),
    }
    text = table(columns, args.threads, args.model or "embedded demo")
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
