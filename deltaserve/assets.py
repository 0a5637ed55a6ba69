"""Where the embedded demo checkpoint lives inside the package."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "assets" / "demo"


class MissingDemoCheckpointError(FileNotFoundError):
    """The package was built without its demo checkpoint, so `model=None` has nothing to load."""


def demo_checkpoint_path() -> Path:
    """The demo checkpoint directory (config.json, model.safetensors, tokenizer.json)."""
    needed = ("config.json", "model.safetensors")
    missing = [name for name in needed if not (DEMO_DIR / name).exists()]
    if missing:
        raise MissingDemoCheckpointError(
            f"the embedded demo checkpoint is missing {', '.join(missing)} in {DEMO_DIR}; "
            "pass model=PATH (a checkpoint directory) instead"
        )
    return DEMO_DIR
