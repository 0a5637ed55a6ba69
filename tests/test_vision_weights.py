"""The vision tower in the engine's weight formats: its projections are model/linear.py's Linear (with a bias),
so a bf16 checkpoint's tower stays bf16, --quantization quantizes it as it loads, and the planner's count of the
tower is the bytes the loaded tower holds."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.planner import weight_parts
from deltaserve.model.linear import Linear
from deltaserve.model.loader import load_model
from tests.test_vision_engine import PICTURES, hf_inputs
from tests.vision_checkpoint import random_hf_vision_model, save_vision_checkpoint

PROJECTIONS = 4 * 2 + 2  # qkv, proj, fc1, fc2 per block (depth 2) and the merger's fc1, fc2


@pytest.fixture(scope="module")
def hf():
    return random_hf_vision_model(seed=3)


def hf_tower_output(hf) -> torch.Tensor:
    inputs = hf_inputs([8186, 8186], PICTURES)  # two placeholders: the processor's pixels and grids
    with torch.no_grad():
        out = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return torch.cat(out), inputs


def tower_output(model, inputs) -> torch.Tensor:
    with torch.inference_mode():
        return model.encode_images(inputs["pixel_values"], [tuple(g) for g in inputs["image_grid_thw"].tolist()])


def tower_projections(model) -> list[Linear]:
    return [m for m in model.visual.modules() if isinstance(m, Linear)]


def test_a_bf16_checkpoints_tower_stays_bf16_with_fp32_biases(hf, tmp_path):
    bf16 = random_hf_vision_model(seed=3).to(torch.bfloat16)
    path = save_vision_checkpoint(bf16, tmp_path / "bf16")
    model = load_model(path)  # the checkpoint's formats, computed in fp32
    projections = tower_projections(model)
    assert len(projections) == PROJECTIONS
    assert all(p.weight.dtype == torch.bfloat16 and p.fmt.name == "bfloat16" for p in projections)
    assert all(p.bias is not None and p.bias.dtype == torch.float32 for p in projections)
    # Same numbers as transformers' tower on the bf16 values widened to fp32.
    ref, inputs = hf_tower_output(bf16.float())
    torch.testing.assert_close(tower_output(model, inputs), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantization_covers_the_tower_and_the_plan_counts_its_bytes(hf, tmp_path, quantization):
    path = save_vision_checkpoint(hf, tmp_path / "fp32")
    model = load_model(path, quantization=quantization)
    projections = tower_projections(model)
    assert {p.fmt.name for p in projections} == {quantization}
    ref, inputs = hf_tower_output(hf)
    out = tower_output(model, inputs)
    assert (out - ref).norm() / ref.norm() < 0.05  # quantized weights: close, not equal
    stored = sum(t.numel() * t.element_size() for t in [*model.visual.parameters(), *model.visual.buffers()]
                 if t is not None)
    parts = weight_parts(ModelConfig.from_file(path), weight_dtype="float32", quantization=quantization)
    (vision,) = [p for p in parts if p.name == "vision tower"]
    assert vision.total_bytes_per_rank == stored
