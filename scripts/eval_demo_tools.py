#!/usr/bin/env python3
"""Held-out tool-use accuracy of a checkpoint (default: the embedded demo) on scripts/corpus/gen_tools.py's
held-out split, through the real engine and the server's qwen3_coder parser.

    .venv/bin/python scripts/eval_demo_tools.py [CHECKPOINT_DIR] [-n 200] [--seed 0] [--json out.json]

First turn (every example): LLM.chat with the example's tools and thinking switch, greedy. The output is split
into reasoning and content as the server does, and the content parsed with qwen3_coder.
  * "call":    a call was made / its name is right / its arguments are exactly right (typed, all of them)
  * "no_call": no call was made
Answer turn ("call" examples): the conversation as the training data has it through the tool's result (the
right call, its reasoning when thinking is on), then LLM.chat again: the answer must contain the result's
key values (gen_tools.answer_keys: the temperature and condition, the number, the time).
Rows: all, per language, per tool (the tool the question is about, offered or not; "none" for general
questions), per thinking.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import gen_tools  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.assets import DEMO_DIR  # noqa: E402
from deltaserve.serve.reasoning import split_reasoning  # noqa: E402
from deltaserve.serve.tool_parsers import Qwen3CoderToolParser, extract_tool_calls, tool_schemas  # noqa: E402

METRICS = ["call_made", "right_name", "right_args", "no_call_ok", "answer_ok"]


@dataclass(slots=True)
class Outcome:
    example: gen_tools.ToolExample
    first_output: str = ""
    calls: list[dict] = field(default_factory=list)  # [{"name", "arguments"}] parsed from the first turn
    answer: str | None = None  # the answer turn's content ("call" examples)

    @property
    def scores(self) -> dict[str, bool]:
        ex = self.example
        if ex.kind == "no_call":
            return {"no_call_ok": not self.calls}
        assert ex.expected_call is not None and self.answer is not None
        first = self.calls[0] if self.calls else None
        right_name = first is not None and first["name"] == ex.expected_call["name"]
        # json.dumps keeps types apart (1 == 1.0 == True in Python); argument order does not matter
        right_args = right_name and len(self.calls) == 1 and _typed(first["arguments"]) == _typed(
            ex.expected_call["arguments"])
        return {"call_made": first is not None, "right_name": right_name, "right_args": right_args,
                "answer_ok": all(k in self.answer for k in gen_tools.answer_keys(ex))}


def _typed(arguments: dict) -> str:
    return json.dumps(arguments, sort_keys=True)


def _chat_grouped(llm: LLM, items: list[tuple[gen_tools.ToolExample, list[dict]]], max_tokens: int) -> list[str]:
    """LLM.chat over conversations batched by (tools, thinking), as one chat call takes one tools list; the
    outputs in the items' order."""
    groups: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for i, (ex, _) in enumerate(items):
        groups[(json.dumps(ex.tools), ex.enable_thinking)].append(i)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    out = [""] * len(items)
    for (tools, thinking), idx in groups.items():
        results = llm.chat([items[i][1] for i in idx], params, use_tqdm=False, tools=json.loads(tools),
                           chat_template_kwargs={"enable_thinking": thinking})
        for i, r in zip(idx, results, strict=True):
            out[i] = r.outputs[0].text
    return out


def evaluate(llm: LLM, examples: list[gen_tools.ToolExample], max_tokens: int = 160) -> list[Outcome]:
    parser = Qwen3CoderToolParser()
    outcomes = [Outcome(ex) for ex in examples]
    firsts = [(ex, ex.messages[: [m["role"] for m in ex.messages].index("user") + 1]) for ex in examples]
    for o, text in zip(outcomes, _chat_grouped(llm, firsts, max_tokens), strict=True):
        o.first_output = text
        _, content = split_reasoning(text, o.example.enable_thinking)
        _, calls = extract_tool_calls(parser, tool_schemas(o.example.tools), content)
        o.calls = [{"name": c.name, "arguments": c.arguments} for c in calls]
    answer_turns = [(o.example, o.example.messages[:-1]) for o in outcomes if o.example.kind == "call"]
    answers = iter(_chat_grouped(llm, answer_turns, max_tokens))
    for o in outcomes:
        if o.example.kind == "call":
            o.answer = split_reasoning(next(answers), o.example.enable_thinking)[1]
    return outcomes


def summarize(outcomes: list[Outcome]) -> dict[str, dict[str, dict[str, float | int]]]:
    """row -> metric -> {"n", "ok", "rate"}, rows: all, lang=…, tool=…, thinking=…"""
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for o in outcomes:
        ex = o.example
        thinking = "on" if ex.enable_thinking else "off"
        rows = ["all", f"lang={ex.lang}", f"tool={ex.topic or 'none'}", f"thinking={thinking}"]
        for metric, ok in o.scores.items():
            for row in rows:
                table[row][metric][0] += 1
                table[row][metric][1] += int(ok)
    return {row: {m: {"n": n, "ok": ok, "rate": ok / n} for m, (n, ok) in cells.items()}
            for row, cells in sorted(table.items(), key=lambda kv: (kv[0] != "all", kv[0]))}


def format_table(summary: dict[str, dict[str, dict[str, float | int]]]) -> str:
    lines = [f"{'':22}" + "".join(f"{m:>14}" for m in METRICS)]
    for row, cells in summary.items():
        line = f"{row:22}"
        for m in METRICS:
            c = cells.get(m)
            line += f"{'-':>14}" if c is None else f"{c['ok']:>5}/{c['n']:<3} {100 * c['rate']:3.0f}%"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", default=str(DEMO_DIR))
    ap.add_argument("-n", type=int, default=200, help="held-out examples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tools", type=int, default=4, help="at most this many tool specs offered per example")
    ap.add_argument("--max-tokens", type=int, default=160, help="per turn")
    ap.add_argument("--json", metavar="PATH", help="also write the summary and every example's outputs as JSON "
                    "to PATH ('-': to stdout, instead of the table)")
    args = ap.parse_args()
    if args.n < 1:
        ap.error("-n must be at least 1")
    rng = random.Random(args.seed)
    examples = [gen_tools.sample(rng, "heldout", max_tools=args.max_tools) for _ in range(args.n)]
    llm = LLM(args.checkpoint, max_model_len=2048, seed=args.seed)
    t0 = time.perf_counter()  # the evaluation alone (loading, and a first kernel build, are not in it)
    outcomes = evaluate(llm, examples, args.max_tokens)
    seconds = time.perf_counter() - t0
    summary = summarize(outcomes)
    if args.json != "-":
        print(format_table(summary))
        print(f"{args.n} held-out examples (seed {args.seed}) in {seconds:.1f}s, checkpoint {args.checkpoint}")
    if args.json:
        detail = [{"question": gen_tools.question(o.example), "kind": o.example.kind, "lang": o.example.lang,
                   "thinking": o.example.enable_thinking, "tools": [t["function"]["name"] for t in o.example.tools],
                   "expected_call": o.example.expected_call, "first_output": o.first_output, "calls": o.calls,
                   "answer": o.answer, "scores": o.scores} for o in outcomes]
        report = {"checkpoint": args.checkpoint, "n": args.n, "seed": args.seed, "seconds": seconds,
                  "summary": summary, "examples": detail}
        if args.json == "-":
            json.dump(report, sys.stdout, ensure_ascii=False, indent=1)
        else:
            with open(args.json, "w") as f:
                json.dump(report, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
