"""benchmarks/widen_checkpoint.py: a widened checkpoint (zero-padded hidden dimensions, wider MLP, appended
identity layers) computes the source's function, MTP head included, within fp32 rounding."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import load_model
from tests.checkpoints import TINY, random_hf_model, random_mtp_tensors, save_official_layout

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from widen_checkpoint import widen  # noqa: E402


def test_a_widened_checkpoint_gives_the_source_logits(tmp_path: Path) -> None:
    src = save_official_layout(random_hf_model(TINY, seed=7), tmp_path / "src", random_mtp_tensors(TINY, seed=8))
    wide = widen(src, tmp_path / "wide", hidden=192, intermediate=128, layers=8, seed=1)
    a, b = load_model(src, dtype="float32"), load_model(wide, dtype="float32")
    assert b.config.hidden_size == 192 and b.config.num_hidden_layers == 8
    assert sum(p.numel() for p in b.parameters()) > 2 * sum(p.numel() for p in a.parameters())
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(3))
    ctx = ForwardContext.stateless([40])
    with torch.no_grad():
        ha, hb = a(ids, ctx), b(ids, ctx)
        torch.testing.assert_close(b.compute_logits(hb), a.compute_logits(ha), atol=1e-5, rtol=1e-4)
        # The MTP head drafts as the source's does: its logits from the same tokens and trunk hiddens.
        ma = a.compute_logits(a.mtp_hidden(ids[1:], ha[:-1], ForwardContext.stateless([39])))
        mb = b.compute_logits(b.mtp_hidden(ids[1:], hb[:-1], ForwardContext.stateless([39])))
        torch.testing.assert_close(mb, ma, atol=1e-5, rtol=1e-4)
    # The padded dimensions stay zero in the residual stream, and the appended layers are real work.
    assert hb[:, 48:].abs().max() == 0
    assert b.model.layers[6].mlp.gate_proj.weight.abs().sum() > 0


def test_the_demo_widens_with_its_vision_tower(tmp_path: Path) -> None:
    """The embedded demo carries a vision tower: it keeps its width, and its image tokens land in the widened
    residual as the source's, zero in the new dimensions and scaled as the embedding is (stream 2 at 4x)."""
    from deltaserve.assets import DEMO_DIR

    wide = widen(DEMO_DIR, tmp_path / "wide", hidden=768, intermediate=512, layers=8)
    a, b = load_model(DEMO_DIR, dtype="float32"), load_model(wide, dtype="float32")
    assert b.config.hidden_size == 768 and b.visual is not None
    grid = (1, 4, 6)
    pixels = torch.randn(24, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ea, eb = a.encode_images(pixels, [grid]), b.encode_images(pixels, [grid])
    torch.testing.assert_close(eb[:, :192], 2 * ea, atol=1e-5, rtol=1e-5)
    assert eb[:, 192:].abs().max() == 0
