"""The inspector's HTTP surface: the page at /inspect and its JSON / SSE API under /inspect/api.

    app = build_app(async_engine, name, extra_routers=[build_inspect_router(async_engine.engine)])

Trace requests run their own stateless forward of the engine's model in a worker thread (one at a time),
never inside an engine step and without touching the engine's caches. The live view reads step events
that the engine's step_listeners hand to a StepEventBus."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from deltaserve.inspect.live import StepEventBus
from deltaserve.inspect.plan_view import allocated_cache, memory_plans
from deltaserve.inspect.shapes import layer_detail
from deltaserve.inspect.tokens import TraceInputError, token_view, tokenize_input
from deltaserve.inspect.trace import attention_lab, forward_trace, gdn_state_lab, layer_kind
from deltaserve.inspect.vision import VisionRecorder
from deltaserve.serve.errors import error_response

STATIC = Path(__file__).resolve().parent / "static"
_MEDIA = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
FAVICON = STATIC / "favicon.svg"
MAX_TRACE_TOKENS = 512
_KEEP_TRACES = 32  # token ids of recent traces, so the labs can be asked by trace id


class TraceBody(BaseModel):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    coords: list[int] | None = None
    top_k: int = 5


class InspectorState:
    """What the routes share: the engine, its step-event bus, recent traces, and the one-trace-at-a-time
    lock (a trace forward competes with serving for the same cores; queueing them bounds that)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.bus = StepEventBus(engine)
        self.vision = VisionRecorder(engine)
        self.lock = threading.Lock()
        self.traces: OrderedDict[str, list[int]] = OrderedDict()

    @property
    def tp(self) -> int:
        return int(getattr(self.engine.config, "tensor_parallel_size", 1) or 1)

    def remember(self, ids: list[int]) -> str:
        tid = uuid.uuid4().hex[:12]
        self.traces[tid] = ids
        while len(self.traces) > _KEEP_TRACES:
            self.traces.popitem(last=False)
        return tid

    def ids_of(self, trace_id: str) -> list[int]:
        ids = self.traces.get(trace_id)
        if ids is None:
            raise LookupError(f"trace {trace_id!r} is unknown or expired; run the trace again")
        return ids

    async def run(self, fn: Any, *args: Any) -> Any:
        def locked() -> Any:
            with self.lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    def model_summary(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "source": "measured",
            "model": getattr(self.engine.config, "model", None) or "embedded demo checkpoint",
            "dtype": str(self.model.activation_dtype).removeprefix("torch."),
            "weight_formats": self.model.weight_formats(),
            "params": sum(t.numel() for t in self.model.parameters()),
            "layer_types": [layer_kind(t) for t in cfg.layer_types],
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "rotary_dim": cfg.rotary_dim, "linear_num_key_heads": cfg.linear_num_key_heads,
            "linear_num_value_heads": cfg.linear_num_value_heads,
            "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "has_tokenizer": self.tokenizer is not None,
            "has_chat_template": getattr(self.tokenizer, "chat_template", None) is not None,
            "max_model_len": self.engine.max_model_len, "max_trace_tokens": MAX_TRACE_TOKENS,
            "tensor_parallel_size": self.tp,
        }


def build_inspect_router(engine: Any) -> APIRouter:
    """engine: the LLMEngine the server runs (AsyncEngine.engine)."""
    state = InspectorState(engine)
    router = APIRouter(prefix="/inspect")
    router.state = state  # type: ignore[attr-defined]  # tests and the CLI reach the bus through it

    async def guarded(fn: Any, *args: Any) -> Response:
        try:
            return JSONResponse(await state.run(fn, *args))
        except LookupError as e:
            return error_response(404, str(e))
        except (ValueError, TraceInputError) as e:
            return error_response(400, str(e))

    @router.get("", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @router.get("/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        path = (STATIC / name).resolve()
        if STATIC not in path.parents or not path.is_file():
            return error_response(404, f"no static file {name!r}")
        return FileResponse(path, media_type=_MEDIA.get(path.suffix, "application/octet-stream"))

    @router.get("/api/model")
    async def model() -> dict[str, Any]:
        return state.model_summary()

    @router.post("/api/trace")
    async def trace(body: TraceBody) -> Response:
        def work() -> dict[str, Any]:
            tp = tokenize_input(state.tokenizer, body.prompt, body.messages, body.token_ids,
                                state.model.config.vocab_size, MAX_TRACE_TOKENS)
            result = forward_trace(state.model, state.tokenizer, tp.ids, body.coords, body.top_k)
            return {"trace_id": state.remember(tp.ids), "text": tp.text,
                    "tokens": token_view(state.tokenizer, tp), **result}

        return await guarded(work)

    @router.get("/api/gdn_state")
    async def gdn_state(trace: str, layer: int, head: int = 0) -> Response:
        return await guarded(lambda: gdn_state_lab(state.model, state.ids_of(trace), layer, head))

    @router.get("/api/attention")
    async def attention(trace: str, layer: int, head: int = 0) -> Response:
        return await guarded(lambda: attention_lab(state.model, state.ids_of(trace), layer, head))

    @router.get("/api/layer")
    async def layer(layer: int, tp: int = 1, tokens: int = Query(1, ge=1)) -> Response:
        e = state.engine
        kv = next(iter(e.cache_tensors.kv.values()))[0].dtype if e.cache_tensors.kv else None
        usage = e.cache.usage()
        return await guarded(layer_detail, state.model, layer, tokens, tp, kv, usage.total_slots,
                             usage.total_blocks, e.cache.block_size)

    @router.get("/api/plan")
    async def plan(max_model_len: int = Query(8192, ge=1), max_num_seqs: int = Query(8, ge=1),
                   kv_cache_dtype: str = "auto", tp: int | None = Query(None, ge=1)) -> Response:
        dtype = state.model.activation_dtype
        return await guarded(memory_plans, state.model.config, dtype, max_model_len, max_num_seqs,
                             kv_cache_dtype, tp or state.tp, allocated_cache(state.engine))

    @router.get("/api/vision")
    async def vision() -> dict[str, Any]:
        return state.vision.summary()

    @router.get("/api/vision/request")
    async def vision_request(request_id: str) -> Response:
        try:  # not behind the trace lock: it reads a record, computes nothing
            return JSONResponse(await asyncio.to_thread(state.vision.request, request_id, state.tokenizer))
        except LookupError as e:
            return error_response(404, str(e))

    @router.get("/api/live", response_class=StreamingResponse,
                responses={200: {"description": "Server-sent events: status, then steps.",
                                 "content": {"text/event-stream": {}}}})
    async def live(request: Request) -> StreamingResponse:
        async def events() -> Any:
            yield _sse("status", state.bus.status())
            async for batch in state.bus.watch():
                if await request.is_disconnected():
                    break
                if not batch:
                    yield ": keepalive\n\n"
                    continue
                # Only the newest step's block map is sent: the grid shows the present, not history.
                for e in batch[:-1]:
                    e = {k: v for k, v in e.items() if k not in ("blocks", "slots")}
                    yield _sse("step", e)
                yield _sse("step", batch[-1])

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
