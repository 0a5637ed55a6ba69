"""The demo sees: a real `deltaserve serve` of the embedded demo, the official `openai` client sending a picture of a
red circle drawn by scripts/corpus/gen_vision.py as a data: URL, asking its colour and its shape in English and
Chinese, and each answer is right."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import openai
import pytest

from deltaserve.assets import DEMO_DIR
from scripts.corpus.gen_vision import COLOURS, SHAPES, Item, Scene, answer_is_right, example_of
from tests.server_process import ServerProcess, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(DEMO_DIR, [], tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED = [c[0] for c in COLOURS].index("red")
CIRCLE = [s[0] for s in SHAPES].index("circle")


# The fine-tuned demo names colours (held out: 100%); shapes are weaker (15-60% held out, the demo's README),
# but a plain red circle in the middle it names in both languages.
@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("kind", ["colour", "shape"])
def test_the_demo_names_the_colour_and_shape_of_a_red_circle(server: ServerProcess, kind: str, lang: str):
    scene = Scene(kind, (245, 245, 240), [Item(CIRCLE, RED, cx=64, cy=64, r=30, angle=0)])
    ex = example_of(scene, lang)  # "What colour is the shape?" / "这个图形是什么颜色？", "What shape is this?", ...
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    content = [{"type": "image_url", "image_url": {"url": data_url(ex.image)}}, {"type": "text", "text": ex.question}]
    out = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=32,
                                         messages=[{"role": "user", "content": content}],
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answer = out.choices[0].message.content
    assert answer_is_right(ex, answer), f"{ex.question} (expected {ex.expected!r}) -> {answer!r}"
