"""Every benchmark script imports: the benchmarks run outside the test suite, so a name moved in the package
would otherwise break one silently (bench_prefix imported the planner's printing after it moved)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_benchmark_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    importlib.import_module(name)
    assert name in sys.modules
