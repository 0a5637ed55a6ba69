"""Pieces every streaming endpoint needs: SSE framing, the per-choice cursor that turns cumulative
engine outputs into deltas (holding back a possible stop-string prefix), and merging several requests'
streams into one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel

from deltaserve.engine.async_engine import EngineDeadError, RequestStream
from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.serve.errors import error_body

DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(e: Exception) -> str:
    """An error after the stream has started (the engine stopped): the 200 is already sent."""
    status = 503 if isinstance(e, EngineDeadError) else 500
    return f"data: {json.dumps(error_body(status, f'{type(e).__name__}: {e}'))}\n\n"


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass(slots=True)
class ChoiceCursor:
    """What of one sequence has been sent. The engine's text is cumulative; while a sequence runs, the
    last `holdback` characters stay back, since a stop string completed later would cut them (see
    deltaserve.engine.detokenizer.stop_holdback)."""

    holdback: int
    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False

    def advance(self, c: CompletionOutput) -> Delta | None:
        if self.done:
            return None
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(self.sent_chars, len(c.text) - self.holdback)
        text = c.text[self.sent_chars : end]
        self.sent_chars = max(self.sent_chars, end)
        tokens = c.token_ids[self.sent_tokens :]
        logprobs = None if c.logprobs is None else c.logprobs[self.sent_tokens : len(c.token_ids)]
        self.sent_tokens = len(c.token_ids)
        self.done = finished
        return Delta(text, tokens, logprobs, c.finish_reason)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(position in `streams`, output) as they come, until every stream has finished. Closing the
    iterator early cancels the readers, which aborts the requests still running."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as e:  # surface the engine's failure to the reader
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
