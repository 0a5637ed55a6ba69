"""The image processor (deltaserve/engine/image_processor.py) against transformers' Qwen2VLImageProcessorPil:
pixel values, grids and placeholder counts, and the errors for pictures it cannot take."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from deltaserve.engine.image_processor import ImageError, ImageProcessor

CONFIG = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.4, 0.3],
          "image_std": [0.2, 0.3, 0.25], "size": {"shortest_edge": 16 * 16, "longest_edge": 128 * 128}}


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    image = Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8),
                            "RGBA" if mode == "RGBA" else "RGB")
    return image.convert(mode) if mode in ("L", "P") else image


@pytest.mark.parametrize("size,mode", [
    ((61, 37), "RGB"),  # odd sides: rounded to multiples of 16
    ((300, 20), "RGBA"),  # elongated, transparency composited on white
    ((5, 9), "L"),  # tiny: scaled up to min pixels
    ((200, 260), "RGB"),  # over max pixels: scaled down
    ((48, 32), "P"),  # palette
])
def test_pixels_and_grid_match_transformers(size, mode):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = picture(*size, mode=mode)
    ref = Qwen2VLImageProcessorPil(**CONFIG)(images=[image], return_tensors="pt")
    ours = ImageProcessor.from_dict(CONFIG)(image)
    assert [list(ours.grid)] == ref["image_grid_thw"].tolist()
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert (ours.pixel_values - ref["pixel_values"]).abs().max().item() == 0.0
    # the placeholder count transformers' Qwen3VLProcessor inserts: grid.prod() // merge**2
    assert ImageProcessor.from_dict(CONFIG).num_tokens(size[1], size[0]) == ref["image_grid_thw"].prod() // 4


def test_min_and_max_pixels_name_forms_are_read():
    proc = ImageProcessor.from_dict({"min_pixels": 1024, "max_pixels": 4096, "patch_size": 8})
    assert (proc.min_pixels, proc.max_pixels, proc.patch_size) == (1024, 4096, 8)
    default = ImageProcessor.from_dict({})
    assert (default.patch_size, default.min_pixels, default.max_pixels) == (16, 65536, 16777216)


def test_pictures_it_cannot_take_get_errors_that_say_why():
    proc = ImageProcessor.from_dict(CONFIG)
    with pytest.raises(ImageError, match="aspect ratio over 200"):
        proc(picture(1000, 4))
    with pytest.raises(ImageError, match="0x5 pixels"):
        proc.resized_size(5, 0)
    with pytest.raises(ImageError, match="must be a PIL.Image.Image, got str"):
        proc("a.png")
