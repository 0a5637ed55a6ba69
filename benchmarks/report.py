"""What every benchmark script shares: a line describing the machine, replacing its own section of
docs/benchmarks.md while leaving the other sections alone, and timing the engine's parts in place."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine() -> str:
    """CPU model, OS, Python and torch versions, and the load average (other work skews timings)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs visible, load average {load}"
    )


def write_section(heading: str, text: str, path: Path = DOC) -> None:
    """Replace the section that starts with `heading` (up to the next '## ' line), or append it."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    text = text.rstrip("\n") + "\n"
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + text + ("\n" + "".join(lines[end:]) if end < len(lines) else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def timed_into(spent: dict[str, float], name: str, fn: Callable) -> Callable:
    """fn, adding the seconds each call takes to spent[name] (a defaultdict(float))."""

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] += time.perf_counter() - t

    return wrapper


class TimedCalls:
    """obj with its calls timed into spent[name]; its attributes (methods the engine also uses on it, such
    as plain_greedy) pass through, so it can stand in for the engine's own object."""

    def __init__(self, obj, spent: dict[str, float], name: str) -> None:
        self._obj, self._call = obj, timed_into(spent, name, obj)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._obj, name)
