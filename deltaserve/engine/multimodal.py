"""A prompt with images, as the engine keeps it: the token ids with each image's <|image_pad|> placeholder
expanded to one token per merged visual token, the images' pixels and grids, their mRoPE positions, and
a content hash per image (prefix caching keeps blocks that read the same ids but other pictures apart)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.config import VisionConfig
from deltaserve.engine.image_processor import ImageProcessor, ProcessedImage
from deltaserve.model.mrope import mrope_positions


class MultiModalError(ValueError):
    """Images that do not fit the prompt or the model; the message names the problem."""


@dataclass(slots=True)
class PromptImage:
    offset: int  # index of its first placeholder token in the (expanded) prompt
    num_tokens: int  # merged visual tokens = placeholders
    pixel_values: torch.Tensor  # [t*h*w, patch_dim]
    grid: tuple[int, int, int]
    hash: str
    source_size: tuple[int, int] | None = None  # (width, height) as sent, before the processor's resize

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(slots=True)
class MultiModalPrompt:
    images: list[PromptImage]
    positions: torch.Tensor  # [3, prompt length] mRoPE positions
    delta: int  # generated token i sits at position i + delta on every row


def check_image_limit(count: int, limit: int | None) -> None:
    """limit_mm_per_prompt's image limit (None: none) for a prompt of `count` images; the server checks it before
    fetching any, build_multimodal_prompt for every prompt."""
    if limit is not None and count > limit:
        raise MultiModalError(f"the prompt has {count} images, more than the limit of {limit} per prompt "
                              "(--limit-mm-per-prompt)")


def build_multimodal_prompt(
    ids: list[int], images: list[Any], vision: VisionConfig | None, processor: ImageProcessor | None,
    limit: int | None = None,
) -> tuple[list[int], MultiModalPrompt]:
    """ids with one <|image_pad|> per image (or an already expanded run of the right length), in order;
    images are PIL images or already processed ones (the server processes them off the engine's thread)."""
    if vision is None or processor is None:
        raise MultiModalError("this model has no vision tower (no vision_config / model.visual.* tensors), "
                              "so it cannot take images")
    check_image_limit(len(images), limit)
    processed = [im if isinstance(im, ProcessedImage) else processor(im) for im in images]
    pad = vision.image_token_id
    runs = _runs(ids, pad)
    if len(runs) != len(processed):
        raise MultiModalError(
            f"the prompt has {len(runs)} image placeholder(s) (<|image_pad|>, token {pad}) but {len(processed)} "
            "image(s) came with it; give one placeholder per image"
        )
    out: list[int] = []
    cursor = 0
    placed = []
    merge = vision.spatial_merge_size
    for (start, length), image in zip(runs, processed, strict=True):
        t, h, w = image.grid
        n = t * (h // merge) * (w // merge)
        if length not in (1, n):
            raise MultiModalError(f"an image placeholder run has {length} tokens; the image needs 1 (expanded "
                                  f"here) or exactly its {n} merged tokens")
        out += ids[cursor:start]
        placed.append((len(out), n, image))
        out += [pad] * n
        cursor = start + length
    out += ids[cursor:]
    positions, delta = mrope_positions(len(out), [(o, im.grid) for o, _, im in placed], merge)
    prompt_images = [PromptImage(o, n, im.pixel_values, im.grid, _hash(im), im.source_size) for o, n, im in placed]
    return out, MultiModalPrompt(prompt_images, positions, delta)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token`."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _hash(image: ProcessedImage) -> str:
    h = hashlib.sha256(repr(image.grid).encode())
    h.update(image.pixel_values.numpy().tobytes())
    return h.hexdigest()
