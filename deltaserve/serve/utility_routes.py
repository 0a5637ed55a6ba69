"""vLLM's utility routes, with its request and response shapes: POST /tokenize (a prompt, or chat messages
through the template), POST /detokenize, GET /version, and GET|POST /ping (SageMaker's health check, the
same answer as /health)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.serve.chat import render_chat_prompt
from deltaserve.serve.errors import APIError
from deltaserve.serve.params import RequestRules
from deltaserve.serve.protocol import ChatMessage, _Request


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def deltaserve_version() -> str:
    try:
        return version("deltaserve")
    except PackageNotFoundError:
        return "unknown"


def build_utility_router(
    engine: AsyncEngine,
    check_model: Callable[[str | None], None],
    rules: RequestRules,
    health: Callable[[], Awaitable[Response]],
) -> APIRouter:
    router = APIRouter()

    def tokenizer() -> Any:
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (served with --skip-tokenizer-init)")
        return engine.tokenizer

    def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        tok = tokenizer()
        if isinstance(body, TokenizeChatRequest):
            text = render_chat_prompt(tok, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
            what = "messages"
        else:
            text, what = body.prompt, "prompt"
        rules.check_text_length(text, engine.max_model_len, what)
        ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
        strs = None
        if body.return_token_strs:
            strs = [t if t is not None else "" for t in tok.convert_ids_to_tokens(ids)]
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    @router.post("/tokenize")
    async def tokenize_route(body: TokenizeChatRequest | TokenizeCompletionRequest) -> TokenizeResponse:
        check_model(body.model)
        return await asyncio.to_thread(tokenize, body)

    @router.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        tok = tokenizer()
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(tok.decode, body.tokens, False)  # special tokens kept, as vLLM
        return DetokenizeResponse(prompt=text)

    @router.get("/version")
    async def version_route() -> VersionResponse:
        return VersionResponse(version=deltaserve_version())

    @router.api_route(
        "/ping", methods=["GET", "POST"], response_class=Response,
        responses={200: {"description": "The engine runs (empty body).", "content": {}}},
    )
    async def ping() -> Response:
        return await health()

    return router
