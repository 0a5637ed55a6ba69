"""The OpenAI-compatible server end to end: a real `deltaserve serve` process (random tiny model, demo
tokenizer) driven by the official `openai` client and raw httpx. Greedy decoding makes streamed and
non-streamed answers comparable; nothing here depends on what the text says."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deltaserve.assets import DEMO_DIR
from deltaserve.serve.reasoning import split_reasoning
from tests.server_process import ServerProcess, running_server, text_checkpoint

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "tokenizer.json").exists(), reason="the demo tokenizer is not in the package yet"
)

KEY = "test-key"
MODEL = "tiny"
MAX_LEN = 2048  # room for a request that outlasts a client's patience (see the disconnect test)
THINK_END = 8191  # `</think>` in the demo tokenizer
USER = [{"role": "user", "content": "Say something."}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    ckpt = text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    args = [
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--max-model-len",
        str(MAX_LEN),
        "--max-num-seqs",
        "32",
    ]
    with running_server(ckpt, args, tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(server: ServerProcess) -> dict[str, float]:
    """Unlabelled view of /metrics: {'deltaserve:num_requests_running': 0.0, ...} (labels dropped)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", headers=AUTH).text.splitlines():
        if line and not line.startswith("#"):
            name, value = re.sub(r"\{.*\}", "", line).rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def aborted(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    found = re.search(
        r'^deltaserve:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        busy = m["deltaserve:num_requests_running"] + m["deltaserve:num_requests_waiting"]
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ---- basics -------------------------------------------------------------------------------------------
def test_health_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key
    assert metrics(server)["deltaserve:kv_cache_total_blocks"] > 0  # known before any request
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0.0)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks[:-1])
    assert content == (choice.message.content or "")
    assert reasoning == (getattr(choice.message, "reasoning_content", None) or "")


def test_completions_streamed_equals_non_streamed_with_stop_string(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # cut mid-output: the stream must hold back
    assert len(stop.strip()) > 0
    full = client.completions.create(**kw, stop=[stop])
    assert full.choices[0].text == text[: text.index(stop)] and full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_text_offsets_point_into_the_returned_text(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="a b c", max_tokens=6, temperature=0.0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    response = client.completions.create(**kw)
    full, prompt_len = response.choices[0], response.usage.prompt_tokens
    streamed = list(client.completions.create(**kw, stream=True))
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    # The echoed prompt's tokens lead the logprobs (the first with none: nothing predicts it).
    assert full.text.startswith("a b c") and full.logprobs.text_offset[0] == 0
    assert full.logprobs.token_logprobs[0] is None and full.logprobs.top_logprobs[0] is None
    assert full.logprobs.text_offset[prompt_len] == len("a b c") and len(full.logprobs.tokens) == prompt_len + 6
    assert offsets == full.logprobs.text_offset
    for token, offset in zip(full.logprobs.tokens, full.logprobs.text_offset):
        assert full.text[offset : offset + len(token)] == token


def test_completion_prompt_forms_n_and_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=3, n=2, logprobs=2, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert "".join(lp.tokens) == c.text or c.finish_reason == "stop"
        assert all(len(t) <= 2 for t in lp.top_logprobs)
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0.0)
    assert ids.usage.prompt_tokens == 3
    many = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0.0)
    assert many.choices[0].text == ids.choices[0].text and many.usage.prompt_tokens == 5


def test_chat_n2_streams_both_choices(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, max_tokens=6, n=2, seed=7, temperature=1.0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason is not None
        content = "".join(d.delta.content or "" for d in mine)
        reasoning = "".join(getattr(d.delta, "reasoning_content", None) or "" for d in mine)
        msg = full.choices[i].message
        assert (content, reasoning) == (msg.content or "", getattr(msg, "reasoning_content", None) or "")


def test_chat_logprobs_in_openai_format(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0.0
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob)  # greedy picks the top one
    assert r.usage.completion_tokens == 4


# ---- reasoning ----------------------------------------------------------------------------------------
def test_reasoning_split_streamed_and_not(client: openai.OpenAI) -> None:
    """logit_bias + frequency_penalty force an output that mixes ` y` and `</think>` tokens; the chat
    answer must be the raw text (seen through /v1/completions on the same prompt) split at `</think>`."""
    from deltaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEMO_DIR)
    y = tok.encode(" y")[0]
    bias = {str(y): 100.0, str(THINK_END): 99.5}  # ` y` first, then the penalty alternates them
    kw = dict(max_tokens=7, temperature=0.0, logit_bias=bias, frequency_penalty=2.0)
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True)
    assert prompt.endswith("<think>\n")
    raw = client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text
    assert "</think>" in raw and not raw.startswith("</think>")
    want_reasoning, want_content = raw.split("</think>", 1)[0], raw.split("</think>", 1)[1].lstrip("\n")
    msg = client.chat.completions.create(model=MODEL, messages=USER, **kw).choices[0].message
    assert (msg.reasoning_content, msg.content) == (want_reasoning, want_content)
    assert split_reasoning(raw, True) == (want_reasoning, want_content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True, **kw))
    assert (
        "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        == want_reasoning
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_content

    off = dict(chat_template_kwargs={"enable_thinking": False})
    msg = client.chat.completions.create(model=MODEL, messages=USER, extra_body=off, **kw).choices[0].message
    assert getattr(msg, "reasoning_content", None) is None and "</think>" in msg.content


# ---- concurrency and disconnects ----------------------------------------------------------------------
def test_sixteen_concurrent_streams(server: ServerProcess) -> None:
    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def streamed(i: int) -> str:
            parts, finish = [], None
            stream = await client.completions.create(
                model=MODEL, prompt=f"request number {i}:", max_tokens=10 + i, temperature=0.0, stream=True
            )
            async for chunk in stream:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            assert finish in ("stop", "length")
            return "".join(parts)

        async def whole(i: int) -> str:
            r = await client.completions.create(
                model=MODEL, prompt=f"request number {i}:", max_tokens=10 + i, temperature=0.0
            )
            return r.choices[0].text

        try:
            a = await asyncio.gather(*(streamed(i) for i in range(16)))
            b = await asyncio.gather(*(whole(i) for i in range(16)))
        finally:
            await client.close()
        return a, b

    streamed_texts, whole_texts = asyncio.run(run())
    assert streamed_texts == whole_texts
    assert len(set(whole_texts)) > 1


def test_disconnected_clients_free_their_cache(server: ServerProcess) -> None:
    before, aborted_before = metrics(server), aborted(server)
    body = {
        "model": MODEL,
        "prompt": "tell me a long story",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.0,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        for _ in range(4):  # streaming clients that read two events and hang up
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                next(line for line in lines if line.startswith("data:"))
        # ...and a non-streaming one that gives up waiting (0.1 s: the server polls every 0.1 s, and its
        # 1900 tokens take far longer, so it is aborted rather than finished)
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/completions", json=dict(body, stream=False, max_tokens=1900), timeout=0.1)
    m = wait_idle(server)
    assert m["deltaserve:num_requests_running"] == 0 and m["deltaserve:num_requests_waiting"] == 0
    assert m["deltaserve:kv_cache_used_blocks"] == 0 and m["deltaserve:gdn_state_used_slots"] == 0
    assert m["deltaserve:kv_cache_total_blocks"] > 0 and m["deltaserve:gdn_state_total_slots"] > 0
    # Aborted before their 4 x 200 + 1900 tokens: generation stopped when the clients left. (How many tokens
    # come before a hang-up is noticed depends on the machine's speed; all five being aborts is the check.)
    assert m["deltaserve:generation_tokens_total"] - before["deltaserve:generation_tokens_total"] < 2400
    assert aborted(server) == aborted_before + 5


def test_metrics_count_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    before = metrics(server)
    client.completions.create(
        model=MODEL, prompt="x y z", max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )
    m = wait_idle(server)
    assert m["deltaserve:request_success_total"] == before["deltaserve:request_success_total"] + 1
    assert m["deltaserve:generation_tokens_total"] >= before["deltaserve:generation_tokens_total"] + 5
    assert m["deltaserve:prompt_tokens_total"] > before["deltaserve:prompt_tokens_total"]
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m[f"deltaserve:{h}_count"] > before.get(f"deltaserve:{h}_count", 0)


# ---- errors -------------------------------------------------------------------------------------------
def _error(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_invalid_fields_are_400_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(extra_body={"top_k": -5}), "top_k"),
        (dict(n=0), "n"),
        (dict(logit_bias={"99999": 1.0}), "logit_bias"),
        (dict(extra_body={"repetition_penalty": 0.0}), "repetition_penalty"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, **kwargs)
        err = _error(info.value)
        assert info.value.status_code == 400 and field in err["message"], (kwargs, err)
        assert err["param"] == field and err["type"] == "invalid_request_error"


def test_malformed_json_and_schema_errors_are_400(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": "many"},
        headers=headers,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=USER, max_tokens=2)
    err = _error(info.value)
    assert "gpt-9" in err["message"] and err["code"] == "model_not_found"


def test_missing_or_wrong_api_key_is_401(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.status_code == 401 and _error(info.value)["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # open only with --disable-metrics-auth


def test_prompt_longer_than_context_is_400_with_both_lengths(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=list(range(10, 10 + MAX_LEN + 40)), max_tokens=1)
    msg = _error(info.value)["message"]
    assert f"maximum context length is {MAX_LEN} tokens" in msg and f"{MAX_LEN + 40} input tokens" in msg
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=MAX_LEN)
    msg = _error(info.value)["message"]
    assert str(MAX_LEN) in msg and f"requested {MAX_LEN + 3} tokens" in msg


def test_default_max_tokens_is_the_rest_of_the_context(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0.0, extra_body={"ignore_eos": True, "stop_token_ids": []}
    )
    assert r.usage.total_tokens == MAX_LEN and r.choices[0].finish_reason == "length"


# ---- the demo checkpoint (skipped until it is in the package) -----------------------------------------
@pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").exists(), reason="no demo checkpoint yet")
def test_demo_model_reasoning_split(tmp_path: Path) -> None:
    """On the real demo model (thinking on by default): whatever it writes, the chat answer is its raw
    text split at the first `</think>`; with thinking off there is no reasoning."""
    from deltaserve.tokenizer import Tokenizer

    proc = ServerProcess(None, ["--max-model-len", "1024"], tmp_path / "demo.log", threads=2)
    try:
        proc.wait_ready()
        c = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        kw = dict(model="deltaserve-demo", max_tokens=160, temperature=0.0)
        prompt = Tokenizer.from_dir(DEMO_DIR).apply_chat_template(msgs, add_generation_prompt=True)
        raw = c.completions.create(prompt=prompt, **kw).choices[0].text
        m = c.chat.completions.create(messages=msgs, **kw).choices[0].message
        assert (m.reasoning_content, m.content) == split_reasoning(raw, True) or (
            "</think>" not in raw and m.content is None and m.reasoning_content == (raw or None)
        )
        off = c.chat.completions.create(
            messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw
        )
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
    finally:
        proc.stop()


def test_bench_client_against_the_server(server: ServerProcess) -> None:
    from deltaserve.serve.bench import format_report, run_bench

    r = asyncio.run(
        run_bench(server.url, None, concurrency=4, num_prompts=8, input_len=8, output_len=6, api_key=KEY)
    )
    assert (r.completed, r.failed, r.output_tokens) == (8, 0, 48)
    assert r.ttft_ms["p50"] > 0 and r.e2e_ms["p99"] >= r.e2e_ms["p50"]
    assert "Output token throughput" in format_report(r)
