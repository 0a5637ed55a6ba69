"""The inspector's vision panel on a real request: a `deltaserve serve` of a random vision checkpoint
(tests/vision_checkpoint.py) answers an image_url chat request through the official `openai` client, then
/inspect/api/vision shows that request's picture, patch grid, <|image_pad|> run and mRoPE positions, and the
page draws them in a headless Chromium (as tests/test_inspect_server.py does)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from deltaserve.engine.image_processor import ImageProcessor
from deltaserve.tokenizer import Tokenizer
from tests.server_process import ServerProcess, running_server
from tests.test_inspect_server import english_page, screenshots_dir
from tests.vision_checkpoint import PREPROCESSOR, random_hf_vision_model, save_vision_checkpoint

WIDTH, HEIGHT = 70, 45  # resized to 64 x 48: an 8 x 6 patch grid of 8 px, 4 x 3 merged tokens
QUESTION = "What is in the picture?"


def png(width: int, height: int, seed: int) -> tuple[Image.Image, str]:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return image, "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vision_checkpoint(random_hf_vision_model(seed=2), tmp_path_factory.mktemp("vision") / "ck")


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(ckpt, [], tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def asked(server: ServerProcess) -> tuple[Image.Image, openai.types.chat.ChatCompletion]:
    """One real image request, answered."""
    picture, url = png(WIDTH, HEIGHT, seed=7)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": QUESTION}]}],
    )
    return picture, out


def test_vision_routes_show_the_requests_grid_tokens_and_positions(server, asked, ckpt):
    picture, out = asked
    summary = httpx.get(f"{server.url}/inspect/api/vision", timeout=30).json()
    assert summary["enabled"] and (summary["patch_size"], summary["merge_size"]) == (8, 2)
    assert summary["requests"][0]["request_id"] == out.id and summary["requests"][0]["num_images"] == 1
    r = httpx.get(f"{server.url}/inspect/api/vision/request", params={"request_id": out.id}, timeout=30)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["prompt_tokens"] == out.usage.prompt_tokens
    (im,) = d["images"]
    H, W = ImageProcessor.from_dict(PREPROCESSOR).resized_size(HEIGHT, WIDTH)
    assert (H, W) == (48, 64)
    assert im["sent_size"] == [WIDTH, HEIGHT] and im["resized_size"] == [W, H]
    assert im["grid_thw"] == [1, 6, 8] and im["merged_grid"] == [1, 3, 4] and im["num_patches"] == 48
    assert (im["patch_size"], im["merge_size"], im["temporal_patch_size"]) == (8, 2, 2)
    # The run sits right after the template's text up to <|vision_start|>, and the text resumes at <|vision_end|>.
    before, image, after = d["segments"]
    assert before["text"].endswith("<|vision_start|>") and after["text"].startswith("<|vision_end|>")
    assert len(Tokenizer.from_dir(ckpt).encode(before["text"])) == before["end"]
    start = before["end"]
    assert (image["kind"], image["start"], image["end"]) == ("image", start, start + 12)
    assert (im["token_start"], im["token_end"], im["num_tokens"]) == (start, start + 12, 12)
    assert after["end"] == d["prompt_tokens"]
    # mRoPE: text counts 0..start-1; merged token (row, col) of the 3 x 4 grid sits at start + (0, row, col);
    # the text after continues one past the image's largest position, start + max(3, 4).
    assert before["first_position"] == [0, 0, 0] and before["last_position"] == [start - 1] * 3
    assert im["positions"] == [[start, start + k // 4, start + k % 4] for k in range(12)]
    assert im["next_text_position"] == [start + 4] * 3 == after["first_position"]
    assert d["mrope_delta"] == 4 - 12
    # The thumbnail is the picture as the tower saw it: the processor's bicubic resize, normalization undone.
    thumb = Image.open(io.BytesIO(base64.b64decode(im["thumbnail"].split(",", 1)[1])))
    assert thumb.size == (W, H) and im["thumbnail_size"] == [W, H]
    resized = np.asarray(picture.resize((W, H), resample=Image.Resampling.BICUBIC), dtype=np.int16)
    assert np.abs(np.asarray(thumb.convert("RGB"), dtype=np.int16) - resized).max() <= 1
    gone = httpx.get(f"{server.url}/inspect/api/vision/request", params={"request_id": "nope"}, timeout=30)
    assert gone.status_code == 404 and "'nope' is not among" in gone.json()["error"]["message"]


def test_picture_undoes_the_patch_order_and_strides_large_pictures():
    processor = ImageProcessor.from_dict(PREPROCESSOR)
    image, _ = png(200, 120, seed=3)
    processed = processor(image)
    H, W = processor.resized_size(120, 200)
    resized = np.asarray(image.resize((W, H), resample=Image.Resampling.BICUBIC), dtype=np.int16)
    whole = processor.picture(processed.pixel_values, processed.grid)
    assert whole.shape == (H, W, 3) and np.abs(whole.astype(np.int16) - resized).max() <= 1
    # at most 64 a side: every 4th pixel of each 8-pixel patch (every 2nd would leave 80 px of 160)
    small = processor.picture(processed.pixel_values, processed.grid, max_side=64)
    assert max(small.shape[:2]) <= 64 and np.array_equal(small, whole[::4, ::4])


def test_vision_panel_in_headless_chromium(server, asked, tmp_path):
    _, out = asked
    shots = screenshots_dir(tmp_path)
    errors: list[str] = []
    with english_page(server.url, errors) as page:
        page.click("nav button[data-tab=vision]")
        page.wait_for_selector(f"#vision-request-detail[data-request='{out.id}']")
        page.wait_for_selector("#vision-grid-0[data-drawn='1']")
        assert "grid_thw (t, h, w) = (1, 6, 8)" in page.text_content("#vision-grid-thw-0")
        start = int(page.get_attribute("#vision-sequence .tok[data-kind='image']", "data-start"))
        assert f"[{start}, {start + 12})" in page.text_content("#vision-span-0")
        # 64 x 48 drawn 6x (384 x 288): merge blocks are 96 px; (x, y) = (250, 110) is row 1, col 2
        assert (page.get_attribute("#vision-grid-0", "width"), page.get_attribute("#vision-grid-0", "height")) \
            == ("384", "288")
        box = page.locator("#vision-grid-0").bounding_box()  # its 1 px border included
        page.mouse.move(box["x"] + 1 + 250, box["y"] + 1 + 110)
        page.wait_for_selector("#vision-tokens-0 tr.sel[data-token='6']")
        hover = page.text_content("#vision-hover-0")
        assert f"prompt index {start + 6}" in hover and f"(t, h, w) = ({start}, {start + 1}, {start + 2})" in hover
        assert page.eval_on_selector_all("#vision-tokens-0 tbody tr", "rs => rs.length") == 12
        page.screenshot(path=str(shots / "vision.png"), full_page=True)
        page.click("#lang-toggle")  # to Chinese: the panel renders again from the same data
        page.wait_for_function("document.querySelector('nav button[data-tab=vision]').textContent === '视觉'")
        page.wait_for_selector("#vision-grid-0[data-drawn='1']")
    assert not errors, errors
