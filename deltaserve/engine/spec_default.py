"""Speculation by default ("auto", EngineConfig.speculative_config's default): adaptive MTP drafting for a
checkpoint that has an MTP head and whose weights stream from memory, off for one that fits in the caches.

Measured (docs/benchmarks.md, "MTP speculation pays where decode is memory-bound"): on a memory-bound
checkpoint (the demo widened to 238M parameters) adaptive k decoded 1.45-1.81x as fast as plain decoding
at batch 1 and as fast at batch 8 (1 and 2 threads); on the 7M-parameter embedded demo, whose steps are
compute-bound in cache and last a fraction of a millisecond, it was measured slower than plain decoding
("adaptive k and the default"). Every released Qwen3.5 checkpoint has 0.8B parameters or more, so the
size rule below only turns it off for toy-sized ones. Greedy output is plain greedy either way, sampled
output keeps the target's distribution, and a seeded sampled request never drafts under adaptive k
(SpecDecoder._num_drafts), so its tokens do not depend on the machine's timings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.planner import text_parts, weight_parts
from deltaserve.model.loader import checkpoint_files

log = logging.getLogger(__name__)

# What "auto" turns on: up to 3 drafts a step, as many as measure to pay for each request.
AUTO_SPECULATIVE_CONFIG = {"method": "mtp", "num_speculative_tokens": 3}
# A text model smaller than this (200 MB in bf16, 50 MB in int4) may sit in a server CPU's last-level cache
# (tens to hundreds of MB), where a verify row costs what a decode row does and speculation cannot pay.
AUTO_MIN_TEXT_PARAMS = 100_000_000


def speculates_by_default(cfg: ModelConfig, has_mtp: bool) -> bool:
    """Whether "auto" turns speculation on: an MTP head and at least AUTO_MIN_TEXT_PARAMS text parameters."""
    if not has_mtp:
        return False
    return sum(p.total_params for p in text_parts(weight_parts(cfg, include_vision=False))) >= AUTO_MIN_TEXT_PARAMS


def auto_speculative_config(path: Path, model: torch.nn.Module | None = None) -> dict[str, Any] | None:
    """What "auto" runs: AUTO_SPECULATIVE_CONFIG where speculates_by_default says so for the checkpoint (or
    the model given instead of it), else None (off)."""
    if model is not None:
        cfg, has_mtp = model.config, getattr(model, "mtp", None) is not None
    else:
        cfg, has_mtp = ModelConfig.from_file(path), any(n.startswith("mtp.") for n in checkpoint_files(path))
    on = speculates_by_default(cfg, has_mtp)
    why = "the checkpoint has no MTP head" if not has_mtp else (
        f"{'at least' if on else 'under'} {AUTO_MIN_TEXT_PARAMS / 1e6:.0f}M text parameters")
    log.info("speculative decoding (auto): %s (%s)", "adaptive MTP, up to 3 drafts" if on else "off", why)
    return dict(AUTO_SPECULATIVE_CONFIG) if on else None
