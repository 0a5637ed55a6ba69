"""Which room of the package may import which (docs/architecture.md): arrows point down only, so the model
knows nothing of executors or the engine, and the kernels nothing of the model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "deltaserve"

# room -> the rooms (deltaserve.<name>) it may import besides itself
ALLOWED = {
    "ops": set(),
    "config": set(),
    "model": {"config", "ops"},
    "cache": {"config", "model", "ops"},
    "executor": {"config", "model", "ops", "cache"},
    "engine": {"config", "model", "ops", "cache", "executor", "sampling", "outputs", "tokenizer", "assets"},
}


def imported_rooms(room: str) -> dict[str, set[str]]:
    """file -> the deltaserve rooms its imports name (absolute imports; the package uses no relative ones)."""
    path = PACKAGE / room
    files = list(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    found = {}
    for f in files:
        rooms = set()
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{f}: relative import"
                names = [node.module]
            rooms |= {n.split(".")[1] for n in names if n.startswith("deltaserve.")}
        found[str(f.relative_to(PACKAGE))] = rooms - {room}
    return found


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_rooms_import_only_downwards(room: str) -> None:
    for file, rooms in imported_rooms(room).items():
        assert rooms <= ALLOWED[room], f"{file} imports {sorted(rooms - ALLOWED[room])}"


def test_only_the_factory_chooses_an_executor() -> None:
    """No module outside deltaserve/executor names the fused executor or asks which executor it has."""
    for f in PACKAGE.rglob("*.py"):
        if f.is_relative_to(PACKAGE / "executor"):
            continue
        text = f.read_text()
        for needle in ("fused_cpu", "FusedTrunk", "FusedMTP", "TorchExecutor"):
            assert needle not in text, f"{f.relative_to(PACKAGE)} names {needle}"
