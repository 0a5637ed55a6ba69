"""The FastAPI app: OpenAI routes under /v1, vLLM's utility routes (/tokenize, /detokenize, /version,
/ping), /health and /metrics, every error in OpenAI's JSON shape. With an API key every route but /health
(and /metrics when `metrics_need_key` is off) wants it (see middleware.RequireAPIKey). Other parts of
deltaserve (the inspector at /inspect) mount their routers through `extra_routers`.

Templating and tokenizing a large request run in a worker thread (prepare_*), so it never stalls the event
loop that streams every other request's tokens; a small one (most) is prepared inline: its few hundred
microseconds cost less than the hop to a thread and back, and requests sent together reach the engine
together (they share its steps)."""

from __future__ import annotations

import asyncio
import logging
import re
import reprlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from deltaserve.engine.media import MediaOptions
from deltaserve.inspect.routes import FAVICON
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams
from deltaserve.serve.chat import image_urls, message_parts
from deltaserve.serve.chat_tools import ToolConfig
from deltaserve.serve.errors import APIError, error_response, from_api_error, param_of, status_phrase
from deltaserve.serve.metrics import CONTENT_TYPE, ServerMetrics
from deltaserve.serve.middleware import CatchServerErrors, LimitRequestBody, RequireAPIKey
from deltaserve.serve.openapi import install_openapi
from deltaserve.serve.params import RequestRules
from deltaserve.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, engine_prompt
from deltaserve.serve.responses import (
    ResponsesRequest,
    ResponseStore,
    prepare_response,
    response_object,
    response_stream,
)
from deltaserve.serve.scoring import PromptScorer
from deltaserve.serve.serving_chat import chat_response, chat_stream, prepare_chat
from deltaserve.serve.serving_completion import (
    completion_response,
    completion_stream,
    prepare_completion,
    score_prompts,
)
from deltaserve.serve.tool_parsers import parser_for_template
from deltaserve.serve.utility_routes import build_utility_router

log = logging.getLogger(__name__)
T = TypeVar("T")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DISCONNECT_POLL_S = 0.1
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
INLINE_BODY_BYTES = 64 * 1024  # bodies up to this are templated and tokenized on the loop (well under 5 ms)


class ClientGone(Exception):
    """The client closed the connection before its non-streaming answer was ready."""


@dataclass(slots=True)
class ServerOptions:
    """What the operator set with `deltaserve serve` flags (see cli_serve.add_server_args)."""

    api_key: str | None = None
    metrics_need_key: bool = True  # --disable-metrics-auth turns it off
    max_request_body_bytes: int = 16 * 1024 * 1024
    rules: RequestRules = field(default_factory=RequestRules)
    media: MediaOptions = field(default_factory=MediaOptions)  # image_url fetching and local files


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    options: ServerOptions | None = None,
    extra_routers: Sequence[APIRouter] = (),
    model_root: str | None = None,
    tool_config: ToolConfig | None = None,
) -> FastAPI:
    options = options or ServerOptions()
    app = FastAPI(title="deltaserve", description="OpenAI-compatible API for Qwen3.5 / Qwen3.8 models")
    metrics = ServerMetrics(served_model_name)
    metrics.attach(async_engine)
    scorer = PromptScorer(async_engine.engine.model)
    rules = options.rules
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name
    if tool_config is None:  # no flags: no auto tool choice, the parser the chat template's format needs
        tool_config = ToolConfig(False, parser_for_template(getattr(async_engine.tokenizer, "chat_template", None)))

    def check_model(model: str | None) -> None:
        if model and model != served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    def card() -> ModelCard:
        return ModelCard(id=served_model_name, root=model_root, max_model_len=async_engine.max_model_len)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        check_model(model_id)
        return card()

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        rules.check(body)
        # Fetching and decoding images never runs on the event loop, however small the body.
        parts = message_parts(body.messages)  # checked once, here, and used by prepare_chat
        offload = bool(image_urls(parts))
        prep = await _prepare(raw, prepare_chat, async_engine, body, tool_config, rules, options.media, parts,
                              offload=offload)
        prompt_logprobs = None
        if body.prompt_logprobs is not None:
            prompt_logprobs = await scorer.score(prep.prompt_token_ids, body.prompt_logprobs)
        stream = await _add(async_engine, prep.request_id, prep.engine_prompt(body.cache_salt), prep.params)
        if body.stream:
            return StreamingResponse(
                chat_stream(async_engine, body, prep, stream, served_model_name),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        out = await _until_disconnect(raw, _last(stream))
        response = chat_response(async_engine, body, prep, out, served_model_name, prompt_logprobs)
        return JSONResponse(response.model_dump(exclude_none=False))

    responses_store = ResponseStore()  # previous_response_id: the last MAX_STORED_RESPONSES, in memory

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        check_model(body.model)
        prep = await _prepare(raw, prepare_response, async_engine, body, tool_config, responses_store, rules)
        chat = prep.chat
        stream = await _add(async_engine, chat.request_id, chat.engine_prompt(body.cache_salt), chat.params)
        if body.stream:
            return StreamingResponse(
                response_stream(async_engine, prep, stream, served_model_name, responses_store),
                media_type="text/event-stream", headers=_SSE_HEADERS,
            )
        out = await _until_disconnect(raw, _last(stream))
        return JSONResponse(response_object(prep, out, served_model_name, responses_store))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        rules.check(body)
        response_id, prepared = await _prepare(raw, prepare_completion, async_engine, body, rules)
        scores = await score_prompts(scorer, body, prepared)
        streams: list[RequestStream | None] = []
        try:
            for p in prepared:
                if p.params is None:  # max_tokens 0 with echo: the prompt is scored, nothing generated
                    streams.append(None)
                    continue
                prompt = engine_prompt(p.token_ids, p.text, body.cache_salt)
                streams.append(await _add(async_engine, p.request_id, prompt, p.params))
        except BaseException:
            for s in streams:
                if s is not None:
                    async_engine.abort(s.request_id)
            raise
        if body.stream:
            return StreamingResponse(
                completion_stream(async_engine, body, response_id, prepared, streams, scores, served_model_name),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        outs = await _until_disconnect(raw, _all_last(streams))
        response = completion_response(async_engine, body, response_id, prepared, outs, scores, served_model_name)
        return JSONResponse(response.model_dump())

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "The engine runs (empty body).", "content": {}}},
    )
    async def health() -> Response:
        if not async_engine.is_running:
            return error_response(503, "the engine is not running")
        try:
            async_engine.engine.check_health()  # a tensor-parallel rank that died
        except RuntimeError as e:
            return error_response(503, f"the engine cannot run steps: {e}")
        return Response(status_code=200)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format.", "content": {CONTENT_TYPE: {}}}},
    )
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return FileResponse(FAVICON, media_type="image/svg+xml")

    app.include_router(v1)
    app.include_router(build_utility_router(async_engine, check_model, rules, health))
    for router in extra_routers:
        app.include_router(router)
    _install_error_handlers(app)
    install_openapi(app, api_key=options.api_key is not None)
    # Added innermost first: the error catcher wraps everything, the key is checked before a body is read.
    app.add_middleware(LimitRequestBody, max_bytes=options.max_request_body_bytes)
    if options.api_key is not None:
        open_paths = ["/health"] if options.metrics_need_key else ["/health", "/metrics"]
        app.add_middleware(RequireAPIKey, api_key=options.api_key, open_paths=open_paths)
    app.add_middleware(CatchServerErrors)
    return app


async def _prepare(raw: Request, fn: Callable[..., T], *args: Any, offload: bool = False) -> T:
    """fn(*args) inline for a small request body, else (or with offload) in a worker thread (see the module
    docstring)."""
    if not offload and len(await raw.body()) <= INLINE_BODY_BYTES:  # the body is already read (and cached) by now
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _add(
    engine: AsyncEngine, request_id: str, prompt: dict[str, Any], params: SamplingParams
) -> RequestStream:
    try:
        return await engine.add_request(request_id, prompt, params)
    except EngineDeadError as e:
        raise APIError(503, str(e)) from e
    except QueueFullError as e:
        raise APIError(503, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    except (ValueError, TypeError) as e:  # PromptTooLongError, token ids outside the vocabulary, logit_bias
        msg = str(e)
        raise APIError(400, msg, param=param_of(msg, ("logit_bias", "prompt", "stop_token_ids"))) from e


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


async def _all_last(streams: list[RequestStream | None]) -> list[RequestOutput | None]:
    # A coroutine, not a bare gather future: cancelling it then cancels the readers cleanly.
    async def last_or_none(s: RequestStream | None) -> RequestOutput | None:
        return None if s is None else await _last(s)

    return list(await asyncio.gather(*(last_or_none(s) for s in streams)))


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work, but cancel it (which aborts its requests) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) of pydantic's first error: where, what, and (briefly) the value it got."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field_in_ctx = (first.get("ctx") or {}).get("field")  # a model-level check names its field here
    where = ".".join([*loc, field_in_ctx] if field_in_ctx else loc) or "body"
    param = loc[0] if loc else re.split(r"[.\[]", field_in_ctx)[0] if field_in_ctx else None
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if "input" in first and first.get("type") not in ("missing", "lone_surrogate"):
        message += f" (got {reprlib.repr(first['input'])})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return message, param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return from_api_error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            detail = (errors[0].get("ctx") or {}).get("error", errors[0].get("msg", ""))
            return error_response(400, f"The request body is not valid JSON: {detail}")
        message, param = validation_message(errors)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        detail = e.detail if isinstance(e.detail, str) else status_phrase(e.status_code)
        response = error_response(e.status_code, detail)
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
