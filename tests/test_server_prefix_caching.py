"""A real `deltaserve serve --enable-prefix-caching`: usage.prompt_tokens_details.cached_tokens is the
reused length, and /metrics counts prefix cache queries and hits and the GDN snapshot memory."""

from __future__ import annotations

import openai
import pytest

from tests.server_process import ServerProcess, text_checkpoint
from tests.test_server import metrics, wait_idle

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> ServerProcess:
    ckpt = text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    args = ["--served-model-name", MODEL, "--max-model-len", "512", "--max-num-seqs", "4",
            "--enable-prefix-caching", "--mamba-block-size", "64"]
    proc = ServerProcess(ckpt, args, tmp_path_factory.mktemp("log") / "server.log")
    request.addfinalizer(proc.stop)
    proc.wait_ready()
    return proc


def test_cached_tokens_in_usage_and_metrics(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    before = metrics(server)
    ids = [(7 * i + 3) % 8000 + 100 for i in range(100)]
    args = dict(model=MODEL, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
    first = client.completions.create(prompt=ids, **args)
    longer = client.completions.create(prompt=ids + [55] * 30, **args)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert longer.usage.prompt_tokens_details.cached_tokens == 96  # the first prompt's last block boundary
    assert longer.choices[0].text  # it still generated

    messages = [{"role": "user", "content": "Tell me about caches. " * 12}]
    chat = [client.chat.completions.create(messages=messages, **args) for _ in range(2)]
    prompt = chat[0].usage.prompt_tokens
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    assert chat[1].usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0
    stream = client.chat.completions.create(messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **args)
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16

    m = wait_idle(server)
    hits = 96 + 2 * ((prompt - 1) // 16 * 16)
    assert m["deltaserve:prefix_cache_hits_total"] - before["deltaserve:prefix_cache_hits_total"] == hits
    queries = m["deltaserve:prefix_cache_queries_total"] - before["deltaserve:prefix_cache_queries_total"]
    assert queries == 100 + 130 + 3 * prompt
    assert m["deltaserve:gdn_snapshot_memory_bytes"] > 0 and m["deltaserve:gdn_snapshot_used"] >= 3
