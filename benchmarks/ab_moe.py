"""profile_moe.py's one-row MoE block and its parts in two checkouts, taking turns (not a test; timing decides
nothing): each round runs one profile process per checkout (its deltaserve, its own TORCH_EXTENSIONS_DIR
DIR/.torch_ext), before and after alternating, so that load on this shared machine hits both alike. Prints,
per format and part, the median over rounds of each round's after / before ratio, and the load average.

    .venv/bin/python benchmarks/ab_moe.py BEFORE_DIR AFTER_DIR [--rounds 5] [--threads 1] [--repeats 200]
        [--formats bf16,int8,int4]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROFILE = Path(__file__).resolve().parent / "profile_moe.py"


def profile(checkout: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(checkout / ".torch_ext"))
    out = subprocess.run([sys.executable, str(PROFILE), "--checkout", str(checkout), "--json",
                          "--threads", str(args.threads), "--repeats", str(args.repeats), "--formats", args.formats],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--formats", default="bf16,int8,int4")
    args = ap.parse_args()
    load = [os.getloadavg()[0]]
    rounds: list[tuple[dict, dict]] = []
    for _ in range(args.rounds):
        rounds.append((profile(args.before, args), profile(args.after, args)))
        load.append(os.getloadavg()[0])
    formats = list(rounds[0][0])
    print(f"after / before, median of {args.rounds} interleaved rounds ({args.repeats} calls each), 1 row, "
          f"{args.threads} thread(s); load average (1 min) {min(load):.1f}-{max(load):.1f}\n")
    print("| part | " + " | ".join(f"{f} before us | {f} after us | {f} ratio" for f in formats) + " |")
    print("|---|" + "---|---|---|" * len(formats))
    for part in rounds[0][0][formats[0]]:
        cells = []
        for f in formats:
            before = statistics.median(b[f][part] for b, _ in rounds)
            after = statistics.median(a[f][part] for _, a in rounds)
            ratio = statistics.median(a[f][part] / b[f][part] if b[f][part] > 0 else float("nan") for b, a in rounds)
            cells.append(f"{before:.1f} | {after:.1f} | {ratio:.2f}")
        print(f"| {part} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
