"""AsyncEngine: one engine thread serving several asyncio callers; errors reach the caller that caused
them; a caller that stops reading aborts its request; an idle engine does not step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
import torch

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine, PromptTooLongError
from deltaserve.sampling import SamplingParams
from tests.checkpoints import TINY, random_hf_model, save_official_layout


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    path: Path = save_official_layout(random_hf_model(TINY, seed=5), tmp_path_factory.mktemp("ckpt"))
    eng = AsyncEngine(LLMEngine(EngineConfig(model=str(path), max_model_len=128))).start()
    yield eng
    eng.shutdown()
    torch.set_num_threads(before)


def test_concurrent_generate_matches_the_offline_engine(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> list[int]:
        outs = [o async for o in engine.generate(f"r{i}", [3 + i, 4, 5], params)]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert len(outs) == 8  # one incremental output per decode step
        return outs[-1].outputs[0].token_ids

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(6)))

    got = asyncio.run(run())
    assert all(len(t) == 8 for t in got) and len({tuple(t) for t in got}) > 1


def test_errors_reach_the_caller_and_the_engine_lives_on(engine: AsyncEngine) -> None:
    async def run() -> None:
        with pytest.raises(PromptTooLongError):
            await engine.add_request("long", list(range(2, 200)), SamplingParams())
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request("vocab", [1, 5000], SamplingParams())
        outs = [o async for o in engine.generate("ok", [3, 4], SamplingParams(max_tokens=2))]
        assert outs[-1].finished

    asyncio.run(run())
    assert engine.is_running


def test_a_cancelled_reader_aborts_its_request(engine: AsyncEngine) -> None:
    """What the server's disconnect does: the task reading the stream is cancelled mid-request."""
    before = engine.engine.generation_tokens

    async def run() -> None:
        stream = await engine.add_request(
            "leaver", [3, 4, 5], SamplingParams(max_tokens=100, ignore_eos=True)
        )
        seen = asyncio.Event()

        async def read() -> None:
            async for _ in stream:
                seen.set()

        task = asyncio.create_task(read())
        await seen.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10  # still inside the loop: no async-generator cleanup at exit helps
        while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    asyncio.run(run())
    usage = engine.engine.cache.usage()  # the thread is idle now: reading is safe
    assert (usage.used_blocks, usage.used_slots) == (0, 0)
    assert engine.engine.generation_tokens - before < 100  # it did not run to its 100 tokens


def test_idle_engine_does_not_step(engine: AsyncEngine) -> None:
    steps = engine.engine.num_steps
    time.sleep(0.3)
    assert engine.engine.num_steps == steps
