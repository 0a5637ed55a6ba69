"""Issue 16, the server attacked as a client would: client mistakes get a 4xx naming the field, the key
guards every route but /health, nothing asked for is dropped without a word, work is bounded, the
OpenAPI document says what the server does, vLLM's utility routes answer in vLLM's shapes. A real
`deltaserve serve` process (random tiny model, demo tokenizer) driven by the `openai` client and httpx."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deltaserve.assets import DEMO_DIR
from deltaserve.tokenizer import Tokenizer
from tests.server_process import ServerProcess, running_server, text_checkpoint

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "tokenizer.json").exists(), reason="the demo tokenizer is not in the package yet"
)

KEY = "hardening-key"
MODEL = "tiny"
MAX_LEN = 512
MAX_N = 4
BODY_CAP = 1_000_000
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    ckpt = text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    args = ["--served-model-name", MODEL, "--api-key", KEY, "--max-model-len", str(MAX_LEN),
            "--max-num-seqs", "8", "--max-n", str(MAX_N), "--max-request-body-bytes", str(BODY_CAP)]
    with running_server(ckpt, args, tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """One keep-alive connection: after an error it must still carry the next request."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


def _post_raw(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes a lone surrogate as the escape "\ud800", which is valid JSON
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- 2. client mistakes are 4xx naming the field, on a connection that stays usable ----------------------
def test_lone_surrogates_are_400_naming_the_field(server: ServerProcess, http: httpx.Client) -> None:
    cases = [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]},
         "messages.0.content", "messages"),
        ("/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
         "messages.0.content[0].text", "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "x\ud800y", "max_tokens": 2}, "prompt", "prompt"),
        ("/v1/completions", {"model": "ti\ud800ny", "prompt": "x", "max_tokens": 2}, "model", "model"),
    ]
    for path, body, where, param in cases:
        err = _err(_post_raw(http, path, body), 400)
        assert where in err["message"] and "surrogate" in err["message"] and err["param"] == param, err
        _still_serves(http)
    log = server.log_path.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log


def test_tool_call_without_arguments_is_400(server: ServerProcess, http: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    err = _err(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}), 400)
    assert "arguments" in err["message"] and err["param"] == "messages", err
    _still_serves(http)
    ok = messages[:1] + [dict(messages[1], tool_calls=[{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}])] + messages[2:]
    r = http.post("/tokenize", json={"model": MODEL, "messages": ok})
    assert r.status_code == 200, r.text
    prompt = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "<function=get_weather>\n<parameter=city>\nParis" in prompt  # the Qwen3.5 call format
    assert "Traceback" not in server.log_path.read_text()


# ---- 3. the key guards every route but /health ---------------------------------------------------------------
def test_every_route_but_health_needs_the_key(server: ServerProcess) -> None:
    guarded = [("GET", "/inspect"), ("GET", "/inspect/api/live"), ("GET", "/inspect/api/model"),
               ("POST", "/inspect/api/trace"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/metrics"),
               ("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/version"), ("GET", "/favicon.ico")]
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for method, path in guarded:
            r = anon.request(method, path, json={"prompt": "x"} if method == "POST" else None)
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert anon.get("/health").status_code == 200
        # A browser on the inspector is asked for the key (HTTP Basic, the key as password) and then sends it.
        assert anon.get("/inspect").headers["www-authenticate"].startswith("Basic")
        basic = {"Authorization": "Basic " + base64.b64encode(f"me:{KEY}".encode()).decode()}
        assert anon.get("/inspect", headers=basic).status_code == 200
        assert anon.get("/inspect/api/model", headers=basic).status_code == 200
        wrong = {"Authorization": "Basic " + base64.b64encode(b"me:nope").decode()}
        assert anon.get("/inspect", headers=wrong).status_code == 401
        r = anon.post("/inspect/api/trace", json={"prompt": "hi"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["trace_id"]


# ---- 4. silent drops ----------------------------------------------------------------------------------
def test_unknown_role_is_400_and_developer_is_system(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "wizard", "content": "x"}, *USER])
    err = info.value.response.json()["error"]
    assert "messages.0.role" in err["message"] and "wizard" in err["message"] and err["param"] == "messages"
    as_system = http.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."}, *USER]})
    as_developer = http.post("/tokenize", json={"messages": [{"role": "developer", "content": "Be brief."}, *USER]})
    assert as_developer.status_code == 200 and as_developer.json()["tokens"] == as_system.json()["tokens"]
    r = client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "developer", "content": "Be brief."}, *USER])
    assert r.usage.prompt_tokens == as_system.json()["count"]


def test_enable_thinking_must_be_a_bool(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": "no"}})
    err = info.value.response.json()["error"]
    assert "enable_thinking" in err["message"] and err["param"] == "chat_template_kwargs"


def test_suffix_and_best_of_are_refused_by_name(client: openai.OpenAI) -> None:
    for kwargs, field in [(dict(suffix="end"), "suffix"), (dict(best_of=3), "best_of")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="a", max_tokens=2, **kwargs)
        err = info.value.response.json()["error"]
        assert "not supported" in err["message"] and err["param"] == field
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=2, n=2, best_of=2)  # best_of == n: fine
    assert len(r.choices) == 2


def test_token_id_prompt_is_echoed(client: openai.OpenAI, tok: Tokenizer) -> None:
    ids = tok.encode("The cat sat")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0.0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0.0)
    assert r.choices[0].text == "The cat sat" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0.0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_max_tokens_0_with_echo_scores_the_prompt(client: openai.OpenAI, tok: Tokenizer) -> None:
    """The score of a prompt token is the logprob the model gave it: generate one token greedily with its
    logprob, then score prompt + that token; both must agree."""
    ids = tok.encode("Once upon a time")
    gen = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0.0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    lp = gen.choices[0].logprobs
    next_id = tok.encode(gen.choices[0].text)
    scored = client.completions.create(model=MODEL, prompt=ids + next_id, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == tok.decode(ids + next_id, skip_special_tokens=False)
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(ids) + len(next_id)
    assert len(choice.logprobs.tokens) == len(ids) + len(next_id) and choice.logprobs.token_logprobs[0] is None
    if len(next_id) == 1:  # the generated token re-encodes to itself: its score is its logprob
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(lp.token_logprobs[0], abs=2e-3)
    assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)  # without echo: nothing to return
    assert info.value.response.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:  # checked although no SamplingParams is built
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=10_000)
    assert info.value.response.json()["error"]["param"] == "logprobs"


def test_prompt_logprobs_in_vllm_shape(http: httpx.Client, tok: Tokenizer) -> None:
    ids = tok.encode("a b c d")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:], strict=True):
        assert str(tid) in entry and 3 <= len(entry) <= 4
        mine = entry[str(tid)]
        assert mine["rank"] >= 1 and mine["logprob"] <= 0 and mine["decoded_token"] == tok.decode([tid], False)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(tid))
        assert ranks[:3] == [1, 2, 3][: len(ranks)]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2,
                                                    "prompt_logprobs": 1})
    body = chat.json()
    assert chat.status_code == 200 and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]


# ---- 6. bounded work ------------------------------------------------------------------------------------
def test_n_past_the_cap_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a", max_tokens=1, n=MAX_N + 1)
    err = info.value.response.json()["error"]
    assert err["param"] == "n" and str(MAX_N) in err["message"]
    assert len(client.completions.create(model=MODEL, prompt="a", max_tokens=1, n=MAX_N).choices) == MAX_N


def test_body_over_the_cap_is_413_in_openai_shape(server: ServerProcess, http: httpx.Client) -> None:
    big = {"model": MODEL, "prompt": "x" * (BODY_CAP + 10), "max_tokens": 1}
    err = _err(http.post("/v1/completions", json=big), 413)
    assert str(BODY_CAP) in err["message"] and err["type"] == "invalid_request_error"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap counts what arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 65536):
            yield data[i : i + 65536]

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    _err(r, 413)
    _still_serves(http)


def test_prompt_length_is_checked_before_tokenizing(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 150_000, "max_tokens": 1})
    err = _err(r, 400)
    assert f"maximum context length is {MAX_LEN}" in err["message"] and "at least" in err["message"]


# ---- 8. the OpenAPI document --------------------------------------------------------------------------
def test_openapi_document_matches_the_server(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    assert '"422"' not in json.dumps(doc)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "401" in chat and "401" not in doc["paths"]["/health"]["get"]["responses"]
    assert "application/json" not in doc["paths"]["/health"]["get"]["responses"]["200"].get("content", {})
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"] or all(k.startswith("text/plain")
                                                                                 for k in metrics)
    r = http.post("/v1/completions", json={"model": MODEL})  # what the document promises for a bad body
    assert r.status_code == 400


# ---- 10. vLLM's utility routes ---------------------------------------------------------------------------
def test_vllm_utility_routes(http: httpx.Client, tok: Tokenizer) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "The cat sat", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("The cat sat") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN and len(r["token_strs"]) == r["count"]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": USER}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(USER, add_generation_prompt=True))
    d = http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert d == {"prompt": "The cat sat"}
    _err(http.post("/detokenize", json={"tokens": [10**9]}), 400)
    _err(http.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)
    assert isinstance(http.get("/version").json()["version"], str)
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_LEN
    assert _err(http.get("/v1/models/other"), 404)["code"] == "model_not_found"
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_unknown_route_and_method_are_openai_shaped(http: httpx.Client) -> None:
    _err(http.get("/v1/nothing"), 404)
    _err(http.get("/v1/completions"), 405)


# ---- 7. start-up ----------------------------------------------------------------------------------------
def test_port_in_use_fails_before_the_model_loads(tmp_path: Path, server: ServerProcess) -> None:
    proc = ServerProcess(None, ["--port", str(server.port)], tmp_path / "busy.log")  # the running server's port
    try:
        rc = proc.proc.wait(60)
    finally:
        proc.stop()
    log = (tmp_path / "busy.log").read_text()
    assert rc == 2 and f"cannot listen on 127.0.0.1:{server.port}" in log and "loading" not in log, log


def test_missing_tokenizer_is_an_error_or_token_ids_only(tmp_path: Path) -> None:
    ckpt = text_checkpoint(tmp_path / "ckpt")
    for f in ckpt.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            f.unlink()
    proc = ServerProcess(ckpt, [], tmp_path / "notok.log")
    try:
        rc = proc.proc.wait(120)
    finally:
        proc.stop()
    log = (tmp_path / "notok.log").read_text()
    assert rc == 2 and "no tokenizer.json" in log and "--skip-tokenizer-init" in log, log

    proc = ServerProcess(ckpt, ["--skip-tokenizer-init", "--max-model-len", "256"], tmp_path / "ids.log")
    try:
        proc.wait_ready()
        c = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0, timeout=60)
        r = c.completions.create(model=str(ckpt), prompt=[5, 6, 7], max_tokens=4, temperature=0.0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].model_extra["token_ids"] and len(r.choices[0].model_extra["token_ids"]) == 4
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=str(ckpt), prompt="text", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=str(ckpt), messages=USER, max_tokens=2)
    finally:
        proc.stop()
