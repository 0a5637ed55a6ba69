"""A real bug in a handler: one 500 in OpenAI's shape, one traceback in the log, and the client's
keep-alive connection still carries its next request. The deltaserve app (real engine, tiny model) runs
under a real uvicorn in a thread, with one extra route, mounted through build_app's extra_routers, that
raises: no route of the server itself is known to fail, which is the point."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import APIRouter

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.serve.app import build_app
from tests.checkpoints import TINY, random_hf_model, save_official_layout
from tests.server_process import free_port


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path: Path = save_official_layout(random_hf_model(TINY, seed=5), tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), max_model_len=128))).start()
    bug = APIRouter()

    @bug.get("/bug")
    async def raise_a_bug() -> None:
        raise RuntimeError("a bug in a handler")

    app = build_app(engine, "tiny", extra_routers=[bug])
    port = free_port()
    # log_config=None: uvicorn's loggers propagate to the root logger, where caplog sees them.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    engine.shutdown()


def test_a_bug_is_one_500_one_traceback_and_the_connection_lives(
    base_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with httpx.Client(base_url=base_url, timeout=30) as c:
        r = c.get("/bug")
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "internal_server_error" and "RuntimeError: a bug in a handler" in err["message"]
        assert r.headers.get("connection", "").lower() != "close"
        after = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert after.status_code == 200, after.text
        responses = [r, after, c.get("/bug"), c.get("/health")]
        assert [x.status_code for x in responses[2:]] == [500, 200]
    # Every response came over the one keep-alive connection: the server never dropped it.
    assert len({id(x.extensions["network_stream"]) for x in responses}) == 1
    tracebacks = [rec for rec in caplog.records if rec.exc_info is not None]
    assert len(tracebacks) == 2, [rec.getMessage() for rec in tracebacks]  # one per bug request
    assert all(rec.name == "deltaserve.serve" for rec in tracebacks)
    assert not any("Exception in ASGI application" in rec.getMessage() for rec in caplog.records)
