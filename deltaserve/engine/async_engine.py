"""AsyncEngine: one LLMEngine driven by one background thread, fed by many asyncio callers.

The engine is not thread-safe, so every call into it happens on the engine thread: callers put add / abort
commands in an inbox, the thread applies them between steps (so requests that arrive while a step runs
join the next one: continuous batching across HTTP requests), and hands each RequestOutput to the
caller's asyncio queue with loop.call_soon_threadsafe. With nothing to do the thread waits on a condition
variable instead of spinning."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown, or a step raised); no request can be served."""


class QueueFullError(RuntimeError):
    """max_waiting sequences already wait for a slot; the request is refused (try again later)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int] | dict[str, Any]
    params: SamplingParams
    stream: _Stream
    accepted: asyncio.Future[None]  # resolved (or failed with the engine's ValueError) once added


@dataclass(slots=True)
class _Abort:
    request_id: str | None  # None: every request (a shutdown's grace period is over)


@dataclass(slots=True)
class RequestStream:
    """The outputs of one accepted request, in order; iterate once. Leaving the iteration early (a
    client gone, a cancelled task) aborts the request so its cache is freed at once."""

    request_id: str
    _engine: AsyncEngine
    _stream: _Stream
    finished: bool = field(default=False)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.finished = True
                yield item
                if item.finished:
                    return
        finally:
            if not self.finished:
                self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting  # sequences waiting for a slot before add_request refuses more
        self._inbox: deque[_Add | _Abort] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # touched only on the engine thread
        self._stopping = False
        self._poked = False  # run one iteration (listeners) even with nothing to do
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
        # Called on the engine thread: after each loop iteration (metrics gauges read engine.stats()),
        # and with every output handed to a caller (metrics per finished request).
        self.iteration_listeners: list[Callable[[LLMEngine], None]] = []
        self.output_listeners: list[Callable[[RequestOutput], None]] = []

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- the caller's side (any asyncio loop) ---------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer  # read-only use (encode / decode) is safe off the engine thread

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def add_request(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams
    ) -> RequestStream:
        """Queue a request and wait until the engine has accepted it; the engine's errors (prompt too
        long, token id outside the vocabulary, ...) are raised here, before any output."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted: asyncio.Future[None] = loop.create_future()
        self._send(_Add(request_id, prompt, params, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added after all
            raise
        return RequestStream(request_id, self, stream)

    async def generate(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLM.generate: incremental outputs of one request, the last with .finished."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache; safe from any thread, for unknown or finished ids too."""
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        """Stop every request (each stream ends with finish_reason "abort"); safe from any thread."""
        self._send(_Abort(None))

    def refresh(self) -> None:
        """Have the engine thread run its iteration listeners soon, even when idle (a new listener
        wants its first reading)."""
        with self._wake:
            self._poked = True
            self._wake.notify()

    def _send(self, cmd: _Add | _Abort) -> None:
        with self._wake:
            # Checked under the lock that _fail_all drains the inbox with: a command queued after that
            # drain would never be answered, leaving its caller waiting forever.
            if self._stopping and isinstance(cmd, _Add):
                raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")
            self._inbox.append(cmd)
            self._wake.notify()

    # ---- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (
                        self._inbox or self._stopping or self._poked or self.engine.has_unfinished_requests()
                    ):
                        self._wake.wait()
                    self._poked = False
                    if self._stopping:
                        break
                    commands = list(self._inbox)
                    self._inbox.clear()
                for cmd in commands:
                    self._apply(cmd)
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
                self._notify_iteration()
        except BaseException as e:  # a step that raises leaves the engine in an unknown state: stop
            log.exception("the engine thread stopped")
            self._error = e
        finally:
            with self._wake:
                self._stopping = True
            self._fail_all(EngineDeadError(f"the engine stopped: {self._error or 'shut down'}"))

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            # The final "abort" output comes from the next step() and reaches the stream, if anyone reads.
            self.engine.abort_request(list(self._streams) if cmd.request_id is None else cmd.request_id)
            return
        try:
            waiting = self.engine.stats().num_waiting
            # An empty queue takes any request, so that one with n past the bound can still run.
            if self.max_waiting is not None and waiting and waiting + cmd.params.n > self.max_waiting:
                raise QueueFullError(
                    f"the server is busy: {waiting} sequences already wait for a slot (--max-waiting-seqs "
                    f"{self.max_waiting}); retry later"
                )
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except Exception as e:  # the caller's error (ValueError etc.): report it to the caller only
            _call(cmd.stream.loop, _set_exception, cmd.accepted, e)
            return
        self._streams[cmd.request_id] = cmd.stream
        _call(cmd.stream.loop, _set_result, cmd.accepted)

    def _deliver(self, out: RequestOutput) -> None:
        for listener in self.output_listeners:
            _guard(listener, out)
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        _call(stream.loop, stream.queue.put_nowait, out)

    def _notify_iteration(self) -> None:
        for listener in self.iteration_listeners:
            _guard(listener, self.engine)

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            pending = list(self._inbox)
            self._inbox.clear()
        for cmd in pending:
            if isinstance(cmd, _Add):
                _call(cmd.stream.loop, _set_exception, cmd.accepted, error)
        for stream in self._streams.values():
            _call(stream.loop, stream.queue.put_nowait, error)
        self._streams.clear()


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)


def _guard(fn: Callable[[Any], None], arg: Any) -> None:
    try:
        fn(arg)
    except Exception:  # a listener's bug must not stop the engine
        log.exception("listener %r failed", fn)
