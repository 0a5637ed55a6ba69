"""A `vllm bench serve`-style load client: N streaming /v1/completions requests at a fixed concurrency,
with prompt and output lengths fixed (ignore_eos), measuring per request TTFT, TPOT, ITL and end-to-end
latency, and overall request / token throughput. Loopback use; timing decides nothing in the tests."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Prompt text is random words from this list: real tokens, no dependence on any one tokenizer.
_WORDS = (
    "the of and to in is was for on with as by at from that this it an be are or have not but which one all "
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work number night point home water "
    "room mother area money story fact month lot right study book eye job word business issue side kind "
    "head house service friend father power hour game line end member law car city community name"
).split()


@dataclass(slots=True)
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return None if self.output_tokens < 2 else (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class BenchResult:
    concurrency: int
    num_prompts: int
    completed: int
    failed: int
    duration: float
    input_tokens: int
    output_tokens: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.duration


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ms = sorted(v * 1000.0 for v in values)

    def pct(q: float) -> float:  # linear interpolation, as numpy.percentile's default
        k = (len(ms) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (k - lo)

    return {"mean": statistics.fmean(ms), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def make_prompts(num: int, input_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    # A distinct leading number per prompt so no two requests are the same.
    return [f"{i} " + " ".join(rng.choice(_WORDS) for _ in range(input_words - 1)) for i in range(num)]


async def _one(
    client: httpx.AsyncClient, model: str, prompt: str, output_len: int, extra: dict[str, Any]
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    res = RequestResult(ok=False, start=time.perf_counter())
    last = res.start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - res.start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_bench(
    url: str,
    model: str | None = None,
    concurrency: int = 1,
    num_prompts: int = 16,
    input_len: int = 64,
    output_len: int = 64,
    api_key: str | None = None,
    seed: int = 0,
    extra_body: dict[str, Any] | None = None,
) -> BenchResult:
    """Send num_prompts requests, at most `concurrency` in flight, and summarise them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, timeout=600, limits=limits
    ) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = make_prompts(num_prompts, input_len, seed)
        gate = asyncio.Semaphore(concurrency)

        async def limited(p: str) -> RequestResult:
            async with gate:
                return await _one(client, model, p, output_len, extra_body or {})

        await _one(client, model, "warm up", 4, extra_body or {})  # first-request costs stay out of it
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    return BenchResult(
        concurrency=concurrency,
        num_prompts=num_prompts,
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=duration,
        input_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=sum(r.output_tokens for r in ok),
        ttft_ms=_percentiles([r.ttft for r in ok]),
        tpot_ms=_percentiles([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=_percentiles([g for r in ok for g in r.itl]),
        e2e_ms=_percentiles([r.latency for r in ok]),
    )


def format_report(r: BenchResult) -> str:
    lines = [
        f"============ Serving Benchmark Result (concurrency {r.concurrency}) ============",
        f"Successful requests:                     {r.completed}",
        f"Failed requests:                         {r.failed}",
        f"Benchmark duration (s):                  {r.duration:.2f}",
        f"Total input tokens:                      {r.input_tokens}",
        f"Total generated tokens:                  {r.output_tokens}",
        f"Request throughput (req/s):              {r.request_throughput:.2f}",
        f"Output token throughput (tok/s):         {r.output_throughput:.2f}",
        f"Total token throughput (tok/s):          {r.total_throughput:.2f}",
    ]
    for title, stats in (
        ("Time to First Token", r.ttft_ms),
        ("Time per Output Token (excl. 1st token)", r.tpot_ms),
        ("Inter-token Latency", r.itl_ms),
        ("End-to-end Latency", r.e2e_ms),
    ):
        lines.append(f"---------------{title}---------------")
        for k in ("mean", "p50", "p90", "p99"):
            lines.append(
                f"{k.capitalize() if k == 'mean' else k.upper()} (ms):".ljust(41) + f"{stats[k]:.2f}"
            )
    return "\n".join(lines)
