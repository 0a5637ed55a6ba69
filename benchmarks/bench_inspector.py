"""Does the inspector slow normal serving? The same engine workloads without the inspector, with its live
step bus attached but nobody watching (a server with /inspect mounted), and with one live watcher (the page
open on the Live engine tab). Rounds are interleaved and the best of each is kept, because the machine is
shared. Not a test: timing decides nothing.

    .venv/bin/python benchmarks/bench_inspector.py [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import machine, write_section  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.inspect.live import StepEventBus  # noqa: E402

SECTION = "## Inspector overhead"


class Watcher:
    """One live-view client: consumes the bus's step events on its own event loop thread."""

    def __init__(self, bus: StepEventBus) -> None:
        self.events = 0
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(bus), self.loop).result()

    async def _start(self, bus: StepEventBus) -> None:
        async def consume() -> None:
            async for batch in bus.watch(max_batch_interval=0.1):
                self.events += len(batch)

        self.task = asyncio.get_running_loop().create_task(consume())
        await asyncio.sleep(0)  # let it register with the bus

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        time.sleep(0.05)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def workloads(llm: LLM) -> dict[str, float]:
    """Seconds for: batch-1 decode of 128 tokens; 16 mixed requests (prompts 16-128, 64 tokens each)."""
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    one = {"prompt_token_ids": [(7 * i + 3) % vocab for i in range(16)]}
    many = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(16, 128))]} for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(one, params, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(many, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    t2 = time.perf_counter()
    return {"decode, batch 1, 128 tokens": 128 / (t1 - t0), "16 requests x 64 tokens": 16 * 64 / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_model_len=1024)
    workloads(llm)  # warm-up
    listeners = list(llm.engine.step_listeners)
    best: dict[str, dict[str, float]] = {}
    events = 0
    for _ in range(args.rounds):
        for mode in ("no inspector", "inspector mounted, nobody watching", "inspector with a live watcher"):
            llm.engine.step_listeners[:] = listeners
            watcher = None
            if mode != "no inspector":
                bus = StepEventBus(llm.engine)
                if mode == "inspector with a live watcher":
                    watcher = Watcher(bus)
            result = workloads(llm)
            if watcher is not None:
                watcher.close()
                events += watcher.events
            for name, value in result.items():
                best.setdefault(mode, {})[name] = max(best.get(mode, {}).get(name, 0.0), value)
    names = list(next(iter(best.values())))
    base = best["no inspector"]
    lines = [
        SECTION,
        "",
        f"Run {datetime.date.today().isoformat()} on {machine()}; `torch.set_num_threads({args.threads})`; "
        f"the embedded demo checkpoint through `LLM`, fp32, greedy, ignore_eos; best of {args.rounds} "
        f"interleaved rounds (output tok/s). The watcher received {events} step events. Produced by "
        "`benchmarks/bench_inspector.py`.",
        "",
        "| mode | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for mode, values in best.items():
        cells = [f"{values[n]:.1f} ({values[n] / base[n]:.2f}x)" for n in names]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
