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


def test_cache_salt_in_the_body_keeps_prefixes_apart(server: ServerProcess) -> None:
    """vLLM's cache_salt through the openai client's extra_body: equal salts share the cached prefix, a
    different salt (or none) does not, on both endpoints; an empty salt is a 400 naming the field."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    ids = [(11 * i + 5) % 8000 + 100 for i in range(90)]

    def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
        out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0.0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert [cached(s) for s in ("alice", "bob", "alice", None, "bob")] == [0, 0, 80, 0, 80]

    messages = [{"role": "user", "content": "Salted caches stay apart. " * 10}]

    def chat_cached(salt: str) -> tuple[int, int]:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0.0,
                                             extra_body={"ignore_eos": True, "cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    first, prompt = chat_cached("carol")
    assert (first, chat_cached("dave")[0], chat_cached("carol")[0]) == (0, 0, (prompt - 1) // 16 * 16)

    for create in (client.completions.create, client.chat.completions.create):
        body = {"prompt": ids} if create == client.completions.create else {"messages": messages}
        with pytest.raises(openai.BadRequestError, match="cache_salt.*non-empty string"):
            create(model=MODEL, max_tokens=2, extra_body={"cache_salt": ""}, **body)

