"""The live view's step-event bus: LLMEngine.step_listeners calls `on_step` on the engine thread after
every step; SSE handlers on the event loop read what it recorded.

Zero cost when nobody looks: with no watcher connected `on_step` returns after one check, so serving pays a
Python call per step and builds nothing. With watchers, each step becomes one snapshot (scheduled
requests, queues, block and slot ownership) in a bounded buffer; watchers are woken through their own
loop (call_soon_threadsafe), and a slow one skips steps rather than holding memory."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Watcher:
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event
    # Set when a wake-up is on its way. Waking a watcher's loop on every step costs the engine thread the
    # GIL hand-off each time (18% of batch-1 decode on the demo); one wake per read is enough.
    signalled: bool = False


def spec_view(engine: Any, stats: Any) -> dict[str, Any]:
    """MTP speculative-decoding counters (EngineStats.spec, vLLM's names) when speculation is on."""
    spec = getattr(stats, "spec", None)
    config = getattr(engine.config, "speculative_config", None)
    if spec is None and not config:
        return {"enabled": False}
    out: dict[str, Any] = {"enabled": True, "config": config}
    if spec is not None:
        out.update(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                   num_accepted_tokens=spec.num_accepted_tokens,
                   accepted_per_position=list(spec.accepted_per_position),
                   acceptance_rate=spec.acceptance_rate, mean_acceptance_length=spec.mean_acceptance_length)
    return out


def prefix_view(engine: Any, stats: Any) -> dict[str, Any]:
    """Prefix caching: vLLM's query / hit counters (tokens), cached and shared KV blocks, the snapshot pool."""
    pc = getattr(stats, "prefix_cache", None)
    if pc is None:
        return {"enabled": False}
    c = stats.cache
    return {"enabled": True, "requests": pc.requests, "queries": pc.queries, "hits": pc.hits,
            "hit_rate": pc.hits / pc.queries if pc.queries else 0.0,
            "cached_blocks": c.cached_blocks, "shared_blocks": c.shared_blocks,
            "snapshots": c.used_snapshots, "total_snapshots": c.total_snapshots,
            "snapshot_bytes": c.snapshot_bytes}


def snapshot(engine: Any, sched: Any) -> dict[str, Any]:
    """One step as plain data, read on the engine thread right after the step (nothing moves meanwhile)."""
    sch = engine.scheduler
    blocks, slots = engine.cache.owners()
    stats = engine.stats()
    scheduled = []
    for s in sched.scheduled:
        drafts = getattr(s, "num_draft_tokens", 0)  # MTP drafts verified in this step (kind "verify")
        scheduled.append({"id": s.request.request_id, "n": s.num_tokens, "kind": s.kind,
                          "context": s.context_len, "drafts": drafts})
    return {
        "step": engine.num_steps, "time": time.time(),
        "budget": sch.max_num_batched_tokens, "max_num_seqs": sch.max_num_seqs,
        "num_tokens": sched.num_tokens, "scheduled": scheduled,
        "waiting": [r.request_id for r in list(sch.waiting)[:64]], "num_waiting": len(sch.waiting),
        "running": [r.request_id for r in list(sch.running)[:64]], "num_running": len(sch.running),
        "preempted": list(sched.preempted), "num_preemptions": stats.num_preemptions,
        "num_blocks": stats.cache.total_blocks, "num_slots": stats.cache.total_slots,
        "blocks": blocks, "slots": slots,
        "prompt_tokens": stats.prompt_tokens, "generation_tokens": stats.generation_tokens,
        "spec": spec_view(engine, stats), "prefix": prefix_view(engine, stats),
    }


class StepEventBus:
    def __init__(self, engine: Any, maxlen: int = 256) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=maxlen)
        self._seq = 0
        self._watchers: dict[int, _Watcher] = {}
        self._ids = itertools.count()
        engine.step_listeners.append(self.on_step)

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    def on_step(self, sched: Any) -> None:
        if not self._watchers:
            return
        try:  # the engine calls listeners unguarded: an inspector bug must never stop serving
            event = snapshot(self.engine, sched)
        except Exception:
            log.exception("inspector: step snapshot failed")
            return
        with self._lock:
            self._seq += 1
            event["seq"] = self._seq
            self._events.append((self._seq, event))
            watchers = list(self._watchers.values())
        for w in watchers:
            if w.signalled:
                continue
            w.signalled = True
            try:
                w.loop.call_soon_threadsafe(w.wake.set)
            except RuntimeError:  # that watcher's loop is closed
                pass

    def since(self, seq: int) -> list[dict[str, Any]]:
        with self._lock:
            return [e for s, e in self._events if s > seq]

    def status(self) -> dict[str, Any]:
        """The engine's state between steps (for a watcher that just connected). Racy but read-only."""
        e = self.engine
        stats = e.stats()
        return {
            "step": e.num_steps, "budget": e.scheduler.max_num_batched_tokens,
            "max_num_seqs": e.scheduler.max_num_seqs, "num_blocks": stats.cache.total_blocks,
            "num_slots": stats.cache.total_slots, "block_size": e.cache.block_size,
            "num_waiting": stats.num_waiting, "num_running": stats.num_running,
            "num_preemptions": stats.num_preemptions, "spec": spec_view(e, stats),
            "prefix": prefix_view(e, stats),
        }

    async def watch(self, max_batch_interval: float = 0.1, keepalive: float = 10.0
                    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Batches of new step events (an empty batch now and then keeps the connection alive). Batches
        are at most ~10 per second, however fast the engine steps."""
        watcher = _Watcher(asyncio.get_running_loop(), asyncio.Event())
        key = next(self._ids)
        with self._lock:
            last = self._seq
            self._watchers[key] = watcher
        try:
            while True:
                try:
                    await asyncio.wait_for(watcher.wake.wait(), keepalive)
                except TimeoutError:
                    yield []
                    continue
                watcher.wake.clear()
                watcher.signalled = False  # before reading: a step recorded from now on wakes us again
                events = self.since(last)
                if events:
                    last = events[-1]["seq"]
                    yield events
                await asyncio.sleep(max_batch_interval)
        finally:
            with self._lock:
                self._watchers.pop(key, None)
