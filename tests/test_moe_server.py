"""A sparse-MoE checkpoint served by the real `deltaserve serve`, called with the real openai client: the
server runs it on the fused C++ step and answers what the offline engine generates."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deltaserve import LLM, SamplingParams
from tests.server_process import ServerProcess, text_checkpoint

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    ckpt = text_checkpoint(tmp_path_factory.mktemp("moe"), seed=5, moe_family="qwen3_next")
    proc = ServerProcess(ckpt, ["--served-model-name", "moe", "--max-model-len", "256"],
                         tmp_path_factory.mktemp("log") / "server.log")
    try:
        proc.wait_ready()
        yield ckpt, proc
    finally:
        proc.stop()


def test_served_moe_completion_equals_the_offline_engine(served: tuple[Path, ServerProcess]) -> None:
    ckpt, server = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    got = client.completions.create(model="moe", prompt=PROMPT, max_tokens=12, temperature=0.0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="moe", prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True))
    want = LLM(model=str(ckpt), max_model_len=256).generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert got.choices[0].text == streamed == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert "executor: fused-cpu" in server.log_path.read_text()
