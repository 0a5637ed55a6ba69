"""Pictures -> the vision tower's input, as transformers' Qwen-VL image processor (Qwen2VLImageProcessorPil)
computes it: RGB (transparency composited on white), a bicubic resize to sides divisible by patch x merge with
the pixel count inside [min_pixels, max_pixels] (smart_resize), rescale by 1/255, normalize, and patches in
merge-block order, each repeated over the temporal patch (a picture is one frame)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class ImageError(ValueError):
    """A picture the processor cannot take (undecodable, empty, too large, extreme aspect); the message says why."""


# Qwen3.5's released preprocessor_config.json (what a checkpoint without one gets).
QWEN3_5_DEFAULTS: dict[str, Any] = {
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
MAX_ASPECT = 200  # transformers' smart_resize refuses anything more elongated


@dataclass(slots=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [t*h*w, C * temporal * patch * patch] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches
    source_size: tuple[int, int] | None = None  # (width, height) of the picture as sent, before the resize


@dataclass(slots=True)
class ImageProcessor:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageProcessor:
        d = {**QWEN3_5_DEFAULTS, **d}
        size = dict(d.get("size") or {})
        # Older configs name the bounds min_pixels / max_pixels; transformers reads them over `size`.
        min_pixels = d.get("min_pixels", size.get("shortest_edge"))
        max_pixels = d.get("max_pixels", size.get("longest_edge"))
        proc = cls(
            patch_size=int(d["patch_size"]), temporal_patch_size=int(d["temporal_patch_size"]),
            merge_size=int(d["merge_size"]), min_pixels=int(min_pixels), max_pixels=int(max_pixels),
            image_mean=tuple(float(x) for x in d["image_mean"]), image_std=tuple(float(x) for x in d["image_std"]),
            rescale_factor=float(d["rescale_factor"]),
        )
        if proc.min_pixels > proc.max_pixels:
            raise ValueError(f"preprocessor_config.json: min pixels {proc.min_pixels} > max pixels {proc.max_pixels}")
        return proc

    @classmethod
    def from_dir(cls, path: Path, patch_size: int, temporal_patch_size: int, merge_size: int) -> ImageProcessor:
        """The checkpoint's preprocessor_config.json, or Qwen3.5's defaults with the tower's own patch sizes."""
        file = path / "preprocessor_config.json"
        if file.exists():
            return cls.from_dict(json.loads(file.read_text()))
        log.info("no preprocessor_config.json in %s: images use Qwen3.5's defaults", path)
        return cls.from_dict(dict(patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                  merge_size=merge_size))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize: sides divisible by patch x merge, pixels within [min, max], aspect kept."""
        if height <= 0 or width <= 0:
            raise ImageError(f"the image is {width}x{height} pixels; it needs at least one pixel each way")
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise ImageError(
                f"the image is {width}x{height} pixels, an aspect ratio over {MAX_ASPECT}; the processor refuses it"
            )
        f = self.factor
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    @property
    def max_tokens_per_image(self) -> int:
        """Merged tokens of the largest picture the resize makes (max_pixels of sides divisible by the factor)."""
        return self.max_pixels // self.factor**2

    def num_tokens(self, height: int, width: int) -> int:
        """Merged tokens (<|image_pad|> placeholders) of a height x width picture."""
        h, w = self.resized_size(height, width)
        return (h // self.factor) * (w // self.factor)

    def __call__(self, image: Any) -> ProcessedImage:
        """A PIL image -> pixel values [h*w, C*tp*p*p] in the tower's patch order and its (1, h, w) grid."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ImageError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        rgb = _to_rgb(image)
        height, width = self.resized_size(rgb.height, rgb.width)
        resized = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
        pixels = np.asarray(resized).transpose(2, 0, 1)  # [C, H, W] uint8
        pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(self.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
        processed = self._patchify(pixels)
        processed.source_size = (image.width, image.height)
        return processed

    def _patchify(self, image: np.ndarray) -> ProcessedImage:
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        c, height, width = image.shape
        gh, gw = height // p, width // p
        patches = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # gh gw mh mw C p p
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
        flat = np.ascontiguousarray(patches).reshape(gh * gw, c * tp * p * p)
        return ProcessedImage(torch.from_numpy(flat), (1, gh, gw))


    def picture(self, pixel_values: torch.Tensor, grid: tuple[int, int, int], max_side: int | None = None
                ) -> np.ndarray:
        """The first frame as the tower sees it (resized), uint8 [H, W, 3]: _patchify and the normalization
        undone. max_side: keep every s-th pixel of each patch (s divides the patch size) so the longest side is
        at most max_side where the patch allows, reading only those pixels (cheap on a large picture)."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        _, gh, gw = grid
        c = pixel_values.shape[1] // (tp * p * p)
        s = 1
        if max_side is not None:
            s = next((d for d in range(1, p + 1) if p % d == 0 and max(gh, gw) * (p // d) <= max_side), p)
        x = pixel_values[: gh * gw].reshape(gh // m, gw // m, m, m, c, tp, p, p)[:, :, :, :, :, 0, ::s, ::s]
        q = x.shape[-1]
        x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(c, gh * q, gw * q).numpy()  # [C, H, W]
        mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(self.image_std, dtype=np.float32)[:, None, None]
        values = (x * std + mean) / self.rescale_factor
        return np.clip(np.rint(values), 0, 255).astype(np.uint8).transpose(1, 2, 0)


def _to_rgb(image: Any) -> Any:
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
