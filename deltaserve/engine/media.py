"""Images named by OpenAI `image_url` parts -> decoded PIL images: `data:` URLs, http(s) URLs (fetched with a
timeout and a size cap) and `file://` paths under `--allowed-local-media-path` only (vLLM's flag); and the
checked content parts of a chat message. Every failure is a MediaError that names the part and the problem
(the server answers it with a 400)."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


class MediaError(ValueError):
    """An image_url (or content part) that cannot be used; the message names the part and the problem."""


# What the Qwen3.5 chat template writes for an image part: the engine expands the pad to the image's tokens.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PART_TYPES = ("text", "image_url", "image_pil")
VIDEO_PART_TYPES = ("video_url", "video")  # OpenAI-style video_url; vLLM's offline "video" part
# vLLM's words for a modality a model does not take (its limit is 0), with what to send instead.
VIDEO_NOT_SUPPORTED = ("video input is not supported: at most 0 video(s) may be provided in one request; "
                       "deltaserve takes images only, so send frames as image_url parts")

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # a decoded picture larger than this is refused (decompression bombs)


@dataclass(slots=True)
class MediaOptions:
    allowed_local_media_path: Path | None = None  # file:// URLs only below it; None: none at all
    fetch_timeout_s: float = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
    max_image_bytes: int = 20 * 1024 * 1024


def load_image(url: Any, where: str, options: MediaOptions) -> Any:
    """The picture at `url` (an image_url part's url), decoded; `where` names the part in errors."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"{where}: image_url.url must be a non-empty string")
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, where)
    elif scheme in ("http", "https"):
        data = _fetch(url, where, options)
    elif scheme == "file":
        data = _local_file(url, where, options)
    else:
        raise MediaError(f"{where}: image_url scheme {scheme or url[:20]!r} is not supported; use a data:, "
                         "http(s): or (with --allowed-local-media-path) file: URL")
    if len(data) > options.max_image_bytes:
        raise MediaError(f"{where}: the image is {len(data)} bytes, more than the limit of "
                         f"{options.max_image_bytes}")
    return _decode(data, where)


def _data_url(url: str, where: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError(f"{where}: a data: URL needs a ',' before its data")
    if not header.endswith(";base64"):
        raise MediaError(f"{where}: only base64 data: URLs are supported (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{where}: the data: URL is not valid base64: {e}") from e


def _fetch(url: str, where: str, options: MediaOptions) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=options.fetch_timeout_s) as response:  # noqa: S310 (http(s) only)
            data = response.read(options.max_image_bytes + 1)
    except urllib.error.HTTPError as e:
        raise MediaError(f"{where}: fetching the image failed: HTTP {e.code} from {url}") from e
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise MediaError(f"{where}: fetching the image failed ({reason}) from {url} within "
                         f"{options.fetch_timeout_s:g} s") from e
    return data


def _local_file(url: str, where: str, options: MediaOptions) -> bytes:
    root = options.allowed_local_media_path
    if root is None:
        raise MediaError(f"{where}: file: URLs are refused; start the server with --allowed-local-media-path "
                         "to allow files under a folder")
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise MediaError(f"{where}: {path} is not under the allowed local media path {root}")
    if not path.is_file():
        raise MediaError(f"{where}: no file at {path}")
    size = path.stat().st_size
    if size > options.max_image_bytes:
        raise MediaError(f"{where}: the image is {size} bytes, more than the limit of {options.max_image_bytes}")
    return path.read_bytes()


def _decode(data: bytes, where: str) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > MAX_IMAGE_PIXELS:
                raise MediaError(f"{where}: the image is {width}x{height} pixels, more than the limit of "
                                 f"{MAX_IMAGE_PIXELS}")
            image = probe.copy()  # decodes it (a truncated file fails here)
    except MediaError:
        raise
    except Exception as e:  # PIL raises many kinds for a file it cannot read
        raise MediaError(f"{where}: the image could not be decoded: {e}") from e
    if image.width == 0 or image.height == 0:
        raise MediaError(f"{where}: the image is {image.width}x{image.height} pixels (empty)")
    return image


def content_parts(content: list[dict[str, Any]], where: str) -> list[tuple[str, Any]]:
    """(kind, value) of each OpenAI content part: ("text", str), ("image_url", url) or ("image_pil", image)
    (vLLM's offline form), checked."""
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(("text", part["text"]))
        elif kind == "image_url":
            image_url = part.get("image_url")
            if not isinstance(image_url, dict) or "url" not in image_url:
                raise MediaError(f'{at}: an image_url part needs "image_url": {{"url": ...}}')
            if image_url.get("detail") not in (None, "auto"):
                raise MediaError(f"{at}: image_url.detail {image_url['detail']!r} is not supported; accepted: auto")
            out.append(("image_url", image_url["url"]))
        elif kind == "image_pil" and "image_pil" in part:
            out.append(("image_pil", part["image_pil"]))
        elif kind == "text":
            raise MediaError(f"{at}: a text part needs a string 'text'")
        elif kind in VIDEO_PART_TYPES:
            raise MediaError(f"{at}: {VIDEO_NOT_SUPPORTED}")
        else:
            raise MediaError(f"{at}: content part type {kind!r} is not supported; accepted: {', '.join(PART_TYPES)} "
                             "(video and audio inputs are not implemented)")
    return out


def render_parts(parts: list[tuple[str, Any]]) -> str:
    """The message text: text parts as they are, each image as its placeholder."""
    return "".join(value if kind == "text" else IMAGE_PLACEHOLDER for kind, value in parts)
