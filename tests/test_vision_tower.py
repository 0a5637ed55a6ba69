"""The vision tower (deltaserve/model/vision.py) against transformers' Qwen3_5VisionModel, and its loading from
the official `model.visual.*` names."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import ConfigError, ModelConfig, UnsupportedFeatureError, VisionConfig
from deltaserve.model.loader import load_model
from deltaserve.model.vision import VisionTower
from tests.vision_checkpoint import VISION, random_hf_vision_model, save_vision_checkpoint

# Odd merged grids (3x5, 7x2), a frame pair (t=2) and a non-square picture bigger than the 4x4 learned grid.
GRIDS = [(1, 6, 10), (1, 14, 4), (2, 4, 6)]


def _pixels(grids, patch_dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=g)


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_vision_model(seed=3)


def test_tower_matches_transformers_on_odd_grids_and_several_images(hf_model):
    cfg = VisionConfig.from_dict(VISION)
    ours = VisionTower(cfg).eval()
    ours.load_state_dict(hf_model.model.visual.state_dict(), strict=True)  # the official names, one to one
    pixels = _pixels(GRIDS, cfg.patch_dim)
    with torch.no_grad():
        ref = hf_model.model.visual(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
        out = ours(pixels, GRIDS)
    assert out.shape == (sum(VisionTower.num_merged_tokens(g, 2) for g in GRIDS), VISION["out_hidden_size"])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # One image alone gives its own rows of the batch: attention never crosses images.
    with torch.no_grad():
        alone = ours(pixels[60:116], [GRIDS[1]])
    torch.testing.assert_close(alone, out[15:29], atol=2e-5, rtol=1e-4)


def test_loader_fills_the_tower_from_model_visual(hf_model, tmp_path):
    path = save_vision_checkpoint(hf_model, tmp_path / "ck")
    model = load_model(path, "float32")
    assert model.visual is not None
    ref = hf_model.model.visual.state_dict()
    for name, p in model.visual.state_dict().items():
        torch.testing.assert_close(p, ref[name], msg=name)


def test_checkpoint_without_tower_loads_text_only(hf_model, tmp_path):
    path = save_vision_checkpoint(hf_model, tmp_path / "ck", with_tower=False)
    model = load_model(path, "float32")
    assert model.visual is None
    with pytest.raises(ValueError, match="no vision tower"):
        model.encode_images(torch.zeros(4, 384), [(1, 2, 2)])


def test_tower_rejects_pixels_that_do_not_fit_the_grids():
    tower = VisionTower(VisionConfig.from_dict(VISION))
    with pytest.raises(ValueError, match=r"expected \(24, 384\)"):
        tower(torch.zeros(23, 384), [(1, 4, 6)])


def test_vision_config_errors_name_the_field():
    with pytest.raises(UnsupportedFeatureError, match="deepstack_visual_indexes"):
        VisionConfig.from_dict(dict(VISION, deepstack_visual_indexes=[0, 1]))
    with pytest.raises(ConfigError, match="num_position_embeddings 15"):
        VisionConfig.from_dict(dict(VISION, num_position_embeddings=15))
    with pytest.raises(ConfigError, match="hidden_act 'relu6'"):
        VisionConfig.from_dict(dict(VISION, hidden_act="relu6"))


def test_wrapper_token_ids_reach_the_vision_config(hf_model):
    cfg = ModelConfig.from_dict(hf_model.config.to_dict())
    assert cfg.vision is not None and cfg.vision.image_token_id == hf_model.config.image_token_id
    assert cfg.vision.rope_theta == hf_model.config.vision_config.rope_parameters["rope_theta"]
