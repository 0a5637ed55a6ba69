"""Fault suite against a real `deltaserve serve` process: many streams whose clients hang up at random
points (before the first token, while prompts are still being prefilled, mid-decode), after which every
KV block and GDN state slot must be free again; and (slow, timing-sensitive) a 10 MB request arriving
while 8 streams run must not stall them."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from deltaserve.assets import DEMO_DIR
from tests.server_process import ServerProcess, running_server, text_checkpoint

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "tokenizer.json").exists(), reason="the demo tokenizer is not in the package yet"
)

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    ckpt = text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    args = ["--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "512"]
    with running_server(ckpt, args, tmp_path_factory.mktemp("log") / "server.log") as proc:
        yield proc


def _gauges(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("deltaserve:") and "{" in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = _gauges(url)
        busy = g["deltaserve:num_requests_running"] + g["deltaserve:num_requests_waiting"]
        if busy == 0 and g["deltaserve:kv_cache_used_blocks"] == 0 or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def test_64_streams_with_random_disconnects_free_every_block_and_slot(server: ServerProcess) -> None:
    rng = random.Random(16)
    # (prompt length, max_tokens, events read before hanging up: 0 = at the headers, during prefill;
    # None = read to the end)
    plans = [(rng.randint(20, 600), rng.randint(8, 60), rng.choice([0, 1, 2, 5, 10, None, None]))
             for _ in range(64)]

    async def one(c: httpx.AsyncClient, i: int, prompt_len: int, max_tokens: int, hang_up: int | None) -> str:
        body = {"model": MODEL, "prompt": [rng.randint(10, 8000) for _ in range(prompt_len)],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        chat = i % 4 == 0  # a quarter through the chat endpoint
        if chat:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x " * prompt_len}],
                    "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen, finish = 0, None
            async for line in r.aiter_lines():
                if hang_up is not None and seen >= hang_up:
                    return "hung up"
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += 1
                    choices = json.loads(line[6:])["choices"]
                    finish = (choices[0]["finish_reason"] if choices else None) or finish
            return f"finished {finish}"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as c:
            return list(await asyncio.gather(*(one(c, i, *p) for i, p in enumerate(plans))))

    results = asyncio.run(run())
    assert results.count("finished length") == sum(1 for p in plans if p[2] is None) > 0
    assert "hung up" in results
    g = _wait_idle(server.url)
    assert g["deltaserve:num_requests_running"] == 0 and g["deltaserve:num_requests_waiting"] == 0
    assert g["deltaserve:kv_cache_used_blocks"] == 0 and g["deltaserve:gdn_state_used_slots"] == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.slow
def test_a_10mb_request_does_not_stall_running_streams(server: ServerProcess) -> None:
    """Timing-sensitive (slow marker): on a shared 2-core machine another process can stall any stream. The
    bound is the issue's 250 ms between a stream's tokens, measured only while the big request is in flight;
    before the fix the event loop froze for 14-18 s on it."""
    gaps: list[float] = []
    window = {"start": float("inf"), "end": float("inf")}

    async def stream(c: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "prompt": "tell a story", "max_tokens": 900, "ignore_eos": True, "stream": True}
        last = None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                now = time.monotonic()
                if last is not None and line.startswith("data: ") and window["start"] <= now <= window["end"] + 0.25:
                    gaps.append(now - last)
                last = now if line.startswith("data: ") else last

    async def big(c: httpx.AsyncClient) -> list[int]:
        await asyncio.sleep(1.0)  # the streams are decoding
        window["start"] = time.monotonic()
        text = "猫坐在垫上。" * (10 * 1024 * 1024 // 18)  # 10 MB of UTF-8
        codes = []
        for path, body in [("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}),
                           ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": text}]})]:
            codes.append((await c.post(path, json=body)).status_code)
        window["end"] = time.monotonic()
        return codes

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            results = await asyncio.gather(*(stream(c) for _ in range(8)), big(c))
        return results[-1]

    codes = asyncio.run(run())
    assert codes == [400, 400]  # far past max_model_len: refused before it is tokenized
    assert gaps and max(gaps) < 0.25, f"longest inter-token gap {max(gaps):.3f} s over {len(gaps)} gaps"
