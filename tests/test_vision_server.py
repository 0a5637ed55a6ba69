"""Images over HTTP: a real `deltaserve serve` of a random vision checkpoint (tests/vision_checkpoint.py), the
official `openai` client sending image_url parts as data:, http: (a server on 127.0.0.1) and file: URLs, each
bad image answered with a 400 that names the problem, and a checkpoint without a tower saying so."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from deltaserve import LLM, SamplingParams
from tests.server_process import ServerProcess, running_server, text_checkpoint
from tests.vision_checkpoint import random_hf_vision_model, save_vision_checkpoint

QUESTION = "What is in the picture?"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the whole answer is content


def png_bytes(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(png_bytes(70, 40, 0))
    (root / "b.png").write_bytes(png_bytes(30, 90, 1))
    (root / "big.png").write_bytes(png_bytes(400, 400, 2))  # over the server's 100 kB cap
    (root / "thin.png").write_bytes(png_bytes(1000, 2, 3))  # aspect ratio 500
    (root / "broken.png").write_bytes(png_bytes(70, 40, 0)[:60])  # truncated
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_vision_checkpoint(random_hf_vision_model(seed=1), tmp_path_factory.mktemp("vision") / "ck")


@pytest.fixture(scope="module")
def server(ckpt: Path, media: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--allowed-local-media-path", str(media / "."), "--limit-mm-per-prompt", '{"image": 2}',
            "--max-image-bytes", "100000", "--image-fetch-timeout", "2"]
    with running_server(ckpt, args, tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def web(media: Path) -> Iterator[str]:
    """A plain HTTP server for the pictures, on 127.0.0.1."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, *urls: str, text: str = QUESTION) -> str:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=6, temperature=0,
                                         messages=[{"role": "user", "content": content}], extra_body=NO_THINKING)
    return out.choices[0].message.content


def test_data_http_and_file_urls_give_the_offline_answer(client, ckpt, media, web):
    picture = Image.open(media / "a.png")
    llm = LLM(str(ckpt))
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                             {"type": "text", "text": QUESTION}]}]
    params = SamplingParams(max_tokens=6, temperature=0)
    offline = llm.chat(messages, params, use_tqdm=False, **NO_THINKING)[0].outputs[0].text
    assert ask(client, data_url((media / "a.png").read_bytes())) == offline
    assert ask(client, f"{web}/a.png") == offline
    assert ask(client, (media / "a.png").as_uri()) == offline
    # two pictures in one prompt, as LLM.chat answers it with image_url parts (file: URLs allowed there too)
    llm_files = LLM(str(ckpt), allowed_local_media_path=str(media))
    parts = [{"type": "image_url", "image_url": {"url": (media / n).as_uri()}} for n in ("a.png", "b.png")]
    two = llm_files.chat([{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}], params,
                         use_tqdm=False, **NO_THINKING)[0].outputs[0].text
    assert ask(client, f"{web}/a.png", f"{web}/b.png") == two


def bad(client: openai.OpenAI, *urls: str, content: list | None = None) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        if content is None:
            ask(client, *urls)
        else:
            client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2,
                                           messages=[{"role": "user", "content": content}])
    return e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)


def test_every_bad_image_gets_a_400_that_names_the_problem(client, media, web, tmp_path):
    assert "not valid base64" in bad(client, "data:image/png;base64,%%%")
    assert "could not be decoded" in bad(client, data_url(b"this is not a picture"))
    assert "could not be decoded" in bad(client, f"{web}/broken.png")
    assert "more than the limit of 100000" in bad(client, f"{web}/big.png")
    assert "aspect ratio over 200" in bad(client, f"{web}/thin.png")
    assert "HTTP 404" in bad(client, f"{web}/missing.png")
    assert "more than the limit of 2 per prompt" in bad(client, *[f"{web}/a.png"] * 3)
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(70, 40, 0))
    assert "not under the allowed local media path" in bad(client, outside.as_uri())
    assert "scheme 'ftp' is not supported" in bad(client, "ftp://127.0.0.1/a.png")
    assert "'input_audio' is not supported" in bad(
        client, content=[{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    assert ("messages[0].content[0]: video input is not supported: at most 0 video(s) may be provided in one "
            "request") in bad(client, content=[video, {"type": "text", "text": QUESTION}])
    # the server is fine after all of them
    assert isinstance(ask(client, data_url((media / "a.png").read_bytes())), str)


def test_a_checkpoint_without_a_tower_says_so(media, tmp_path):
    ckpt = text_checkpoint(tmp_path / "text")
    with running_server(ckpt, [], tmp_path / "server.log") as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=60)
        assert "no vision tower" in bad(client, data_url((media / "a.png").read_bytes()))


def test_bad_server_flags_are_refused(ckpt, tmp_path):
    proc = ServerProcess(ckpt, ["--allowed-local-media-path", str(tmp_path / "nope")], tmp_path / "s.log")
    with pytest.raises(RuntimeError, match="is not a folder"):
        proc.wait_ready(60)
    proc = ServerProcess(ckpt, ["--limit-mm-per-prompt", json.dumps({"video": 1})], tmp_path / "t.log")
    with pytest.raises(RuntimeError, match="video is not supported"):
        proc.wait_ready(60)
