"""Held-out accuracy of a vision checkpoint on the demo's picture questions (scripts/corpus/gen_vision.py), per
question kind and language, through the real engine: LLM.chat with image_pil parts, greedy, with thinking off,
on, or both. An answer is right when gen_vision.answer_is_right says so (with thinking, the answer after
</think> must be there).

    python scripts/eval_demo_vision.py [CHECKPOINT] [--n 200] [--seed 0] [--thinking both] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus.gen_vision import KINDS, LANGS, VisionExample, answer_is_right, sample  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.assets import DEMO_DIR  # noqa: E402

MODES = {"off": False, "on": True}
MAX_TOKENS = {False: 32, True: 160}  # an answer is one short sentence; thinking adds two more


def heldout_examples(n: int, seed: int) -> list[VisionExample]:
    """n held-out examples, the kinds and languages in turn (so every cell of the table gets its share)."""
    rng = random.Random(seed)
    cells = [(k, lang) for k in KINDS for lang in LANGS]
    return [sample(rng, "heldout", *cells[i % len(cells)]) for i in range(n)]


def evaluate(llm: LLM, examples: list[VisionExample], thinking: bool, samples: int = 0) -> dict[str, Any]:
    """Accuracy overall and per kind and language of one mode; `samples` of the outputs kept for reading."""
    conversations = [[{"role": "user", "content": [{"type": "image_pil", "image_pil": ex.image},
                                                   {"type": "text", "text": ex.question}]}] for ex in examples]
    params = SamplingParams(max_tokens=MAX_TOKENS[thinking], temperature=0)
    outputs = llm.chat(conversations, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": thinking})
    texts = [o.outputs[0].text for o in outputs]
    right = [answer_is_right(ex, text, thinking=thinking) for ex, text in zip(examples, texts, strict=True)]
    table: dict[str, dict[str, dict[str, int]]] = {k: {lang: {"right": 0, "total": 0} for lang in LANGS}
                                                   for k in KINDS}
    for ex, ok in zip(examples, right, strict=True):
        table[ex.kind][ex.lang]["right"] += ok
        table[ex.kind][ex.lang]["total"] += 1
    return {
        "accuracy": sum(right) / max(len(right), 1),
        "by_kind": {k: {lang: _rate(c) for lang, c in row.items()} for k, row in table.items()},
        "counts": table,
        "samples": [{"kind": ex.kind, "lang": ex.lang, "question": ex.question, "expected": ex.expected,
                     "output": text, "right": ok}
                    for ex, text, ok in list(zip(examples, texts, right, strict=True))[:samples]],
    }


def _rate(cell: dict[str, int]) -> float | None:
    return cell["right"] / cell["total"] if cell["total"] else None


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['checkpoint']}: {result['n']} held-out examples (seed {result['seed']}), "
             f"{result['seconds']:.0f} s"]
    for mode, r in result["modes"].items():
        lines.append(f"\nthinking {mode}: accuracy {r['accuracy']:.3f}")
        lines.append("| kind | " + " | ".join(LANGS) + " |")
        lines.append("|---|" + "---|" * len(LANGS))
        for kind, row in r["by_kind"].items():
            cells = ["-" if row[lang] is None else f"{row[lang]:.2f}" for lang in LANGS]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        for s in r["samples"]:
            lines.append(f"  [{'ok' if s['right'] else 'no'}] {s['question']} -> {s['output']!r}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", type=Path, default=DEMO_DIR)
    ap.add_argument("--n", type=int, default=200, help="held-out examples (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--thinking", choices=["off", "on", "both"], default="both")
    ap.add_argument("--samples", type=int, default=3, help="outputs shown per mode")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    if args.n <= 0:
        ap.error(f"--n must be positive, got {args.n}")
    config = json.loads((args.checkpoint / "config.json").read_text())
    if not config.get("vision_config"):
        ap.error(f"{args.checkpoint} has no vision tower (no vision_config in config.json); nothing to evaluate")
    start = time.time()
    llm = LLM(str(args.checkpoint), enable_prefix_caching=False)
    examples = heldout_examples(args.n, args.seed)
    modes = list(MODES) if args.thinking == "both" else [args.thinking]
    result = {"checkpoint": str(args.checkpoint), "n": args.n, "seed": args.seed,
              "modes": {m: evaluate(llm, examples, MODES[m], args.samples) for m in modes}}
    result["seconds"] = time.time() - start
    print(json.dumps(result, indent=1, ensure_ascii=False) if args.json else report(result))


if __name__ == "__main__":
    main()
