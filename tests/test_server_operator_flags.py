"""The operator's flags on a real `deltaserve serve` process: /metrics opened with --disable-metrics-auth,
generation_config.json defaults (--generation-config), the bounded waiting queue (503 + Retry-After), and
SIGTERM: running requests drain (each stream still ends with a finish_reason and [DONE]), the port closes,
the process exits 0. The generation config and the queue are also checked without a server below."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from deltaserve.assets import DEMO_DIR
from deltaserve.engine.generation_config import generation_defaults
from tests.server_process import ServerProcess, running_server, text_checkpoint

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "tokenizer.json").exists(), reason="the demo tokenizer is not in the package yet"
)

KEY = "operator-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
USER = [{"role": "user", "content": "Say something."}]
GEN_CONFIG = {"temperature": 0.7, "top_k": 1, "max_new_tokens": 7, "do_sample": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    ckpt = text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    gen = tmp_path_factory.mktemp("gen")
    (gen / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    args = ["--served-model-name", MODEL, "--api-key", KEY, "--disable-metrics-auth", "--max-model-len", "2048",
            "--max-num-seqs", "1", "--max-waiting-seqs", "1", "--generation-config", str(gen),
            "--shutdown-grace-s", "2"]
    with running_server(ckpt, args, tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_generation_config_modes() -> None:
    assert generation_defaults(DEMO_DIR, "auto") == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    assert generation_defaults(DEMO_DIR, "vllm") == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(DEMO_DIR, "/nonexistent")


def test_bad_generation_config_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults(tmp_path, str(tmp_path))


def test_metrics_open_with_disable_metrics_auth(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_generation_config_fills_what_the_request_leaves_out(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw, seed=1)
    b = client.chat.completions.create(**kw, seed=2)
    assert a.usage.completion_tokens == b.usage.completion_tokens == 7  # max_new_tokens
    assert a.choices[0].message == b.choices[0].message  # top_k 1: greedy whatever the seed
    # The request's own values win.
    c = client.chat.completions.create(**kw, max_tokens=3)
    assert c.usage.completion_tokens == 3
    own = dict(kw, extra_body={"ignore_eos": True, "top_k": 0}, temperature=1.0)
    texts = {str(client.chat.completions.create(**own, seed=s).choices[0].message) for s in range(3)}
    assert len(texts) > 1


def test_full_queue_is_503_with_retry_after(server: ServerProcess) -> None:
    """One slot (--max-num-seqs 1), one waiting place (--max-waiting-seqs 1): of four long requests sent
    together, two at most are taken while the first runs; the others are told to come back."""
    body = {"model": MODEL, "prompt": "tell a long story", "max_tokens": 1200, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4))))

    responses = asyncio.run(run())
    full = [r for r in responses if r.status_code == 503]
    assert len(full) >= 2 and all(r.status_code == 200 for r in responses if r not in full)
    for r in full:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    m = httpx.get(f"{server.url}/metrics").text
    assert "deltaserve:num_requests_waiting" in m


def _refuses_connections(url: str, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=5)
        except httpx.ConnectError:
            return True
        time.sleep(0.1)
    return False


def test_abort_all_ends_every_stream_with_abort(tmp_path: Path) -> None:
    """What the end of the grace period does, without a clock: every running request ends "abort"."""
    from deltaserve.engine.async_engine import AsyncEngine
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.sampling import SamplingParams
    from tests.checkpoints import TINY, random_hf_model, save_official_layout

    ckpt = save_official_layout(random_hf_model(TINY, seed=5), tmp_path)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(ckpt), max_model_len=512))).start()

    async def run() -> list[str | None]:
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        readers = [(await engine.add_request(f"r{i}", [3, 4, 5], params)).__aiter__() for i in range(3)]
        firsts = [await r.__anext__() for r in readers]
        assert not any(f.finished for f in firsts)  # each has begun
        engine.abort_all()
        finals = []
        for r in readers:
            last = None
            async for out in r:
                last = out
            finals.append(None if last is None else last.outputs[0].finish_reason)
        return finals

    try:
        assert asyncio.run(run()) == ["abort"] * 3
        usage = engine.engine.stats().cache
        assert usage.used_blocks == 0 and usage.used_slots == 0
    finally:
        engine.shutdown()


def test_sigterm_drains_running_streams_and_exits_0(server: ServerProcess) -> None:
    """Runs last in this module: it stops the server. A stream longer than the 2 s grace period is
    aborted at its end, with finish_reason "abort" and [DONE]; the process exits 0."""
    events: list[dict] = []
    done = threading.Event()
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
        done.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    assert _refuses_connections(server.url)  # no new connections while it drains
    assert server.proc.wait(30) == 0
    assert done.wait(10)
    assert events[-1] == {"done": True}
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")]
    assert finish[-1] in ("length", "abort") and all(f is None for f in finish[:-1])
    log = server.log_path.read_text()
    assert "Traceback" not in log


def test_llm_generate_without_sampling_params_uses_the_generation_config(tmp_path: Path) -> None:
    from deltaserve.engine.llm import LLM
    from deltaserve.sampling import SamplingParams
    from tests.checkpoints import TINY, random_hf_model, save_official_layout

    ckpt = save_official_layout(random_hf_model(TINY, seed=5), tmp_path)
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 1, "max_new_tokens": 5}))
    llm = LLM(model=str(ckpt), max_model_len=64)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=1, max_tokens=5)
    prompt = {"prompt_token_ids": [3, 4, 5]}
    default = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert list(default) == list(greedy.token_ids)  # top_k 1 is greedy, and 5 tokens at most
    assert LLM(model=str(ckpt), max_model_len=64, generation_config="vllm").get_default_sampling_params() == (
        SamplingParams())
