"""The vision panel's record of real requests: for each recent request with images, the pictures as the
tower sees them (a thumbnail), their patch grids, where their merged tokens (the <|image_pad|> runs) sit in
the prompt, and every merged token's (t, h, w) mRoPE position, as the engine computed them.

LLMEngine.multimodal_listeners calls `on_request` once per accepted request with images, on the engine's
thread: it keeps small summaries only (a thumbnail of at most THUMB_SIDE pixels a side, never the pixel
values), so a bounded number of requests costs a bounded few hundred kB; the JSON is made when asked."""

from __future__ import annotations

import base64
import io
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltaserve.engine.multimodal import MultiModalPrompt

log = logging.getLogger(__name__)

THUMB_SIDE = 256  # longest side of a kept thumbnail, pixels
KEEP_REQUESTS = 16
TEXT_CHARS = 400  # text shown of one text segment of the prompt


@dataclass(slots=True)
class ImageRecord:
    offset: int  # first <|image_pad|> token of the image in the prompt
    num_tokens: int  # merged tokens
    grid: tuple[int, int, int]  # (t, h, w) in patches
    source_size: tuple[int, int] | None  # (width, height) as sent
    thumbnail: np.ndarray  # [h, w, 3] uint8, the first frame as the tower sees it, downscaled


@dataclass(slots=True)
class VisionRecord:
    request_id: str
    time: float
    prompt_token_ids: list[int]
    positions: torch.Tensor  # [3, prompt length] mRoPE positions
    delta: int  # generated token i sits at position i + delta on every row
    images: list[ImageRecord]


class VisionRecorder:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.vision = engine.model_config.vision
        self.processor = engine.image_processor
        self._lock = threading.Lock()
        self._records: OrderedDict[str, VisionRecord] = OrderedDict()
        engine.multimodal_listeners.append(self.on_request)

    @property
    def enabled(self) -> bool:
        """The engine takes images (a loaded tower and its processor)."""
        return self.processor is not None and self.vision is not None

    def on_request(self, request_id: str, ids: list[int], mm: MultiModalPrompt) -> None:
        try:  # the engine calls listeners unguarded: an inspector bug must never refuse a request
            images = [
                ImageRecord(im.offset, im.num_tokens, im.grid, im.source_size,
                            _thumbnail(self.processor.picture(im.pixel_values, im.grid, THUMB_SIDE)))
                for im in mm.images
            ]
        except Exception:
            log.exception("inspector: recording the images of %s failed", request_id)
            return
        record = VisionRecord(request_id, time.time(), list(ids), mm.positions, mm.delta, images)
        with self._lock:
            self._records[request_id] = record
            while len(self._records) > KEEP_REQUESTS:
                self._records.popitem(last=False)

    def summary(self) -> dict[str, Any]:
        """Whether images are on, the tower's cut, and the recent image requests, newest first."""
        with self._lock:
            records = list(self._records.values())[::-1]
        v = self.vision
        return {
            "enabled": self.enabled,
            "patch_size": v.patch_size if v else None,
            "temporal_patch_size": v.temporal_patch_size if v else None,
            "merge_size": v.spatial_merge_size if v else None,
            "requests": [{"request_id": r.request_id, "time": r.time, "num_images": len(r.images),
                          "prompt_tokens": len(r.prompt_token_ids)} for r in records],
        }

    def request(self, request_id: str, tokenizer: Any) -> dict[str, Any]:
        with self._lock:
            record = self._records.get(request_id)
        if record is None:
            raise LookupError(f"request {request_id!r} is not among the last {KEEP_REQUESTS} requests with "
                              "images; send one and look again")
        return request_view(record, self.vision.patch_size, self.vision.spatial_merge_size,
                            self.vision.temporal_patch_size, tokenizer)


def request_view(record: VisionRecord, patch: int, merge: int, temporal_patch: int, tokenizer: Any
                 ) -> dict[str, Any]:
    """One request's vision path as plain data."""
    positions = record.positions
    T = len(record.prompt_token_ids)
    images = []
    for i, im in enumerate(record.images):
        t, h, w = im.grid
        end = im.offset + im.num_tokens
        images.append({
            "index": i, "token_start": im.offset, "token_end": end, "num_tokens": im.num_tokens,
            "grid_thw": [t, h, w], "merged_grid": [t, h // merge, w // merge], "num_patches": t * h * w,
            "patch_size": patch, "merge_size": merge, "temporal_patch_size": temporal_patch,
            "sent_size": None if im.source_size is None else list(im.source_size),
            "resized_size": [w * patch, h * patch],
            "thumbnail": _png_data_url(im.thumbnail),
            "thumbnail_size": [im.thumbnail.shape[1], im.thumbnail.shape[0]],
            "positions": positions[:, im.offset:end].T.tolist(),  # [num_tokens, 3] (t, h, w) per merged token
            "next_text_position": positions[:, end].tolist() if end < T else None,
        })
    return {
        "request_id": record.request_id, "time": record.time, "prompt_tokens": T, "mrope_delta": record.delta,
        "segments": _segments(record, tokenizer), "images": images,
    }


def _segments(record: VisionRecord, tokenizer: Any) -> list[dict[str, Any]]:
    """The prompt cut into text and image runs, each with its token range and first / last position."""
    ids, pos = record.prompt_token_ids, record.positions
    bounds = [(im.offset, im.offset + im.num_tokens, i) for i, im in enumerate(record.images)]
    out, cursor = [], 0

    def span(kind: str, start: int, end: int, **extra: Any) -> dict[str, Any]:
        return {"kind": kind, "start": start, "end": end, "first_position": pos[:, start].tolist(),
                "last_position": pos[:, end - 1].tolist(), **extra}

    def text(start: int, end: int) -> None:
        if end > start:
            words = tokenizer.decode(ids[start:end], skip_special_tokens=False) if tokenizer is not None else ""
            out.append(span("text", start, end, text=words[:TEXT_CHARS]))

    for start, end, i in bounds:
        text(cursor, start)
        out.append(span("image", start, end, image=i))
        cursor = end
    text(cursor, len(ids))
    return out


def _thumbnail(pixels: np.ndarray) -> np.ndarray:
    """At most THUMB_SIDE a side (picture() gets there by striding unless a grid is wider than that)."""
    h, w = pixels.shape[:2]
    if max(h, w) <= THUMB_SIDE:
        return pixels
    from PIL import Image

    scale = THUMB_SIDE / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.asarray(Image.fromarray(pixels).resize(size, resample=Image.Resampling.BILINEAR))


def _png_data_url(pixels: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
