"""POST /v1/completions: one engine request per prompt (a string, token ids, or a list of either), each
with n sequences; choice index = prompt index * n + sequence index, as in OpenAI's API."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deltaserve.engine.async_engine import AsyncEngine, RequestStream
from deltaserve.engine.detokenizer import stop_holdback
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams
from deltaserve.serve.errors import APIError
from deltaserve.serve.logprobs import completion_logprobs
from deltaserve.serve.params import to_sampling_params
from deltaserve.serve.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from deltaserve.serve.streaming import DONE, ChoiceCursor, merge_streams, sse, sse_error
from deltaserve.serve.structured import check_compiles, structured_from_request


@dataclass(slots=True)
class PreparedPrompt:
    request_id: str
    text: str | None
    token_ids: list[int]
    params: SamplingParams


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in p):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


def prepare_completion(engine: AsyncEngine, req: CompletionRequest) -> tuple[str, list[PreparedPrompt]]:
    """(response id, one prepared engine request per prompt)."""
    base = random_id("cmpl")
    structured, field = structured_from_request(req.response_format, req.structured_outputs, req.model_extra)
    if structured is not None:
        check_compiles(engine, structured, field)
    prepared = []
    for i, prompt in enumerate(_prompts(req)):
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send prompt as token ids", param="prompt")
            text, ids = prompt, engine.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise APIError(400, f"prompt {i} is empty; it needs at least one token", param="prompt")
        params = to_sampling_params(req, len(ids), engine.max_model_len)
        params.structured_outputs = structured
        prepared.append(PreparedPrompt(f"{base}-{i}", text, ids, params))
    return base, prepared


def _usage(outs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outs))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=cached)


def completion_response(
    engine: AsyncEngine, req: CompletionRequest, response_id: str, outs: list[RequestOutput], model: str
) -> CompletionResponse:
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            text = c.text
            start = 0
            if req.echo and out.prompt is not None:
                text = out.prompt + text
                start = len(out.prompt)  # text_offset counts from the start of the returned text
            logprobs = None
            if req.logprobs is not None and c.logprobs is not None:
                logprobs = completion_logprobs(engine.tokenizer, c.token_ids, c.logprobs, req.logprobs, start)
            choices.append(
                CompletionChoice(
                    index=i * req.n + c.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    return CompletionResponse(id=response_id, model=model, choices=choices, usage=_usage(outs))


async def completion_stream(
    engine: AsyncEngine,
    req: CompletionRequest,
    response_id: str,
    prepared: list[PreparedPrompt],
    streams: list[RequestStream],
    model: str,
) -> AsyncIterator[str]:
    created = int(time.time())
    cursors = [[ChoiceCursor(stop_holdback(p.params)) for _ in range(req.n)] for p in prepared]
    # text_offset of the next token, counted from the start of the choice's text (the echoed prompt too)
    offsets = [[len(p.text or "") if req.echo else 0] * req.n for p in prepared]
    last: dict[int, RequestOutput] = {}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        if req.echo:
            for i, p in enumerate(prepared):
                for j in range(req.n):
                    if p.text:
                        yield _chunk(response_id, created, model, i * req.n + j, p.text, None, None)
        async for i, out in merge_streams(streams):
            last[i] = out
            for c in out.outputs:
                d = cursors[i][c.index].advance(c)
                if d is None or not (d.text or d.finish_reason or (req.logprobs is not None and d.token_ids)):
                    continue
                logprobs = None
                if req.logprobs is not None and d.logprobs:
                    logprobs = completion_logprobs(
                        engine.tokenizer, d.token_ids, d.logprobs, req.logprobs, offsets[i][c.index]
                    )
                # Advance by the same measure text_offset uses (each token's text), not by the emitted
                # delta, which can be shorter while a stop string is held back.
                offsets[i][c.index] += sum(map(len, logprobs.tokens)) if logprobs else len(d.text)
                yield _chunk(
                    response_id,
                    created,
                    model,
                    i * req.n + c.index,
                    d.text,
                    logprobs,
                    d.finish_reason,
                    c.stop_reason,
                )
        if include_usage:
            yield sse(
                CompletionStreamResponse(
                    id=response_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=_usage(list(last.values())),
                )
            )
        yield DONE
    except Exception as e:  # headers are sent: report in-band, as OpenAI and vLLM do
        yield sse_error(e)
        yield DONE
    finally:
        for p, s in zip(prepared, streams, strict=True):
            if not s.finished:
                engine.abort(p.request_id)


def _chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    logprobs: CompletionLogprobs | None,
    finish_reason: str | None,
    stop_reason: int | str | None = None,
) -> str:
    choice = CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason
    )
    return sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))
