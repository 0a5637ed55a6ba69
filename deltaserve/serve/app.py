"""The FastAPI app: OpenAI routes under /v1 (behind the API key when one is set), /health and /metrics
open, every error in OpenAI's JSON shape. Other parts of deltaserve (the inspector at /inspect) mount
their routers through `extra_routers`."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams
from deltaserve.serve.chat_tools import ToolConfig
from deltaserve.serve.errors import APIError, error_response, from_api_error, param_of, status_phrase
from deltaserve.serve.metrics import CONTENT_TYPE, ServerMetrics
from deltaserve.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from deltaserve.serve.responses import (
    ResponsesRequest,
    ResponseStore,
    prepare_response,
    response_object,
    response_stream,
)
from deltaserve.serve.serving_chat import chat_response, chat_stream, prepare_chat
from deltaserve.serve.serving_completion import completion_response, completion_stream, prepare_completion
from deltaserve.serve.tool_parsers import parser_for_template

log = logging.getLogger(__name__)
T = TypeVar("T")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DISCONNECT_POLL_S = 0.1


class ClientGone(Exception):
    """The client closed the connection before its non-streaming answer was ready."""


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    extra_routers: Sequence[APIRouter] = (),
    model_root: str | None = None,
    tool_config: ToolConfig | None = None,
) -> FastAPI:
    app = FastAPI(title="deltaserve", description="OpenAI-compatible API for Qwen3.5 / Qwen3.8 models")
    metrics = ServerMetrics(served_model_name)
    metrics.attach(async_engine)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name
    if tool_config is None:  # no flags: no auto tool choice, the parser the chat template's format needs
        tool_config = ToolConfig(False, parser_for_template(getattr(async_engine.tokenizer, "chat_template", None)))

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "Incorrect API key provided."
                if header
                else "Missing API key: send 'Authorization: Bearer KEY'.",
                code="invalid_api_key",
            )

    def check_model(model: str | None) -> None:
        if model and model != served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(
            data=[ModelCard(id=served_model_name, root=model_root, max_model_len=async_engine.max_model_len)]
        )

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        prep = prepare_chat(async_engine, body, tool_config)
        stream = await _add(
            async_engine,
            prep.request_id,
            {"prompt": prep.prompt, "prompt_token_ids": prep.prompt_token_ids},
            prep.params,
        )
        if body.stream:
            return StreamingResponse(
                chat_stream(async_engine, body, prep, stream, served_model_name),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        out = await _until_disconnect(raw, _last(stream))
        return JSONResponse(chat_response(async_engine, body, prep, out, served_model_name).model_dump())

    responses_store = ResponseStore()  # previous_response_id: the last MAX_STORED_RESPONSES, in memory

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        check_model(body.model)
        prep = prepare_response(async_engine, body, tool_config, responses_store)
        chat = prep.chat
        stream = await _add(
            async_engine, chat.request_id, {"prompt": chat.prompt, "prompt_token_ids": chat.prompt_token_ids},
            chat.params,
        )
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
        response_id, prepared = prepare_completion(async_engine, body)
        streams: list[RequestStream] = []
        try:
            for p in prepared:
                prompt = (
                    {"prompt_token_ids": p.token_ids}
                    if p.text is None
                    else {"prompt": p.text, "prompt_token_ids": p.token_ids}
                )
                streams.append(await _add(async_engine, p.request_id, prompt, p.params))
        except BaseException:
            for s in streams:
                async_engine.abort(s.request_id)
            raise
        if body.stream:
            return StreamingResponse(
                completion_stream(async_engine, body, response_id, prepared, streams, served_model_name),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        outs = await _until_disconnect(raw, _all_last(streams))
        return JSONResponse(
            completion_response(async_engine, body, response_id, outs, served_model_name).model_dump()
        )

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return error_response(503, "the engine is not running")
        try:
            async_engine.engine.check_health()  # a tensor-parallel rank that died
        except RuntimeError as e:
            return error_response(503, f"the engine cannot run steps: {e}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(v1)
    for router in extra_routers:
        app.include_router(router)
    _install_error_handlers(app)
    return app


async def _add(
    engine: AsyncEngine, request_id: str, prompt: dict[str, Any], params: SamplingParams
) -> RequestStream:
    try:
        return await engine.add_request(request_id, prompt, params)
    except EngineDeadError as e:
        raise APIError(503, str(e)) from e
    except (ValueError, TypeError) as e:  # PromptTooLongError, token ids outside the vocabulary, logit_bias
        msg = str(e)
        raise APIError(400, msg, param=param_of(msg, ("logit_bias", "prompt", "stop_token_ids"))) from e


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return last


async def _all_last(streams: list[RequestStream]) -> list[RequestOutput]:
    # A coroutine, not a bare gather future: cancelling it then cancels the readers cleanly.
    return list(await asyncio.gather(*(_last(s) for s in streams)))


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


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return from_api_error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"The request body is not valid JSON: {first.get('msg', '')}")
        where = ".".join(loc) or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
        if "input" in first and first.get("type") != "missing":
            message += f" (got {first['input']!r})"[:300]
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return error_response(400, message, param=loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        detail = e.detail if isinstance(e.detail, str) else status_phrase(e.status_code)
        return error_response(e.status_code, detail)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")
