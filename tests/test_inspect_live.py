"""The live view's step bus on a real engine, without HTTP: nothing is built while nobody watches; with a
watcher every step becomes an event (prefill / decode, or verify + MTP drafts when speculating)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.inspect import live
from deltaserve.inspect.live import StepEventBus, _Watcher
from tests.test_spec_decode import _agreeing_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _agreeing_checkpoint(tmp_path_factory.mktemp("mtp"), damp=0.3)


def _watch(bus: StepEventBus) -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()  # never run: the bus only schedules wake-ups on it
    bus._watchers[0] = _Watcher(loop, asyncio.Event())
    return loop


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(4)]


def test_no_watcher_builds_nothing(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=32)
    bus = StepEventBus(llm.engine)
    monkeypatch.setattr(live, "snapshot", lambda *a: pytest.fail("snapshot built with nobody watching"))
    llm.generate(_prompts(), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert bus.since(0) == []


def test_steps_with_mtp_drafts(path: Path) -> None:
    llm = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=32,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    bus = StepEventBus(llm.engine)
    loop = _watch(bus)
    try:
        llm.generate(_prompts(), SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        loop.close()
    events = bus.since(0)
    assert [e["step"] for e in events] == list(range(1, llm.engine.num_steps + 1))
    kinds = {s["kind"] for e in events for s in e["scheduled"]}
    assert "prefill" in kinds and "verify" in kinds
    assert all(e["num_tokens"] <= e["budget"] for e in events)
    assert any(s["drafts"] == 2 for e in events for s in e["scheduled"] if s["kind"] == "verify")
    spec = events[-1]["spec"]
    assert spec["enabled"] and spec["num_draft_tokens"] > 0
    assert 0 < spec["acceptance_rate"] <= 1 and spec["mean_acceptance_length"] >= 1
    assert events[-1]["blocks"] == {} and events[-1]["slots"] == {}  # all freed at the end


def test_steps_show_the_prefix_cache(path: Path) -> None:
    llm = LLM(model=str(path), max_model_len=256, max_num_batched_tokens=64, enable_prefix_caching=True)
    bus = StepEventBus(llm.engine)
    loop = _watch(bus)
    shared = list(range(3, 80))
    try:
        llm.generate([{"prompt_token_ids": shared}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        llm.generate([{"prompt_token_ids": shared + [5, 6]}, {"prompt_token_ids": shared + [7]}],
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        loop.close()
    events = bus.since(0)
    last = events[-1]["prefix"]
    assert last["enabled"] and last["hits"] == 2 * 64 and last["queries"] == 77 + 79 + 78
    assert last["snapshots"] >= 1 and last["snapshot_bytes"] > 0 and last["cached_blocks"] >= 4
    assert any(e["prefix"]["shared_blocks"] == 4 for e in events)  # both hits hold the 4 prefix blocks
    assert bus.status()["prefix"]["enabled"]
    off = LLM(model=str(path), max_model_len=256, enable_prefix_caching=False)
    assert StepEventBus(off.engine).status()["prefix"] == {"enabled": False}
