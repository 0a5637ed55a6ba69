"""POST /v1/completions: one engine request per prompt (a string, token ids, or a list of either), each
with n sequences; choice index = prompt index * n + sequence index, as in OpenAI's API. With echo the
prompt (token-id prompts decoded) leads each choice, and with logprobs its tokens' logprobs lead too;
max_tokens 0 with echo scores the prompt without generating."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deltaserve.engine.async_engine import AsyncEngine, RequestStream
from deltaserve.engine.detokenizer import stop_holdback
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams
from deltaserve.serve.errors import APIError
from deltaserve.serve.logprobs import completion_logprobs, echo_logprobs, joined, prompt_logprobs_field
from deltaserve.serve.params import RequestRules, check_context, scores_only, to_sampling_params
from deltaserve.serve.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from deltaserve.serve.scoring import PromptScorer, TokenScore
from deltaserve.serve.streaming import DONE, ChoiceCursor, merge_streams, sse, sse_error
from deltaserve.serve.structured import check_compiles, structured_from_request


@dataclass(slots=True)
class PreparedPrompt:
    request_id: str
    text: str | None  # None for a token-id prompt
    token_ids: list[int]
    params: SamplingParams | None  # None: nothing to generate (max_tokens 0 with echo)
    echo_text: str = ""  # what echo puts before the output: the prompt, token ids decoded


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in p):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


def prepare_completion(
    engine: AsyncEngine, req: CompletionRequest, rules: RequestRules | None = None
) -> tuple[str, list[PreparedPrompt]]:
    """(response id, one prepared engine request per prompt). Tokenizes: run it off the event loop."""
    base = random_id("cmpl")
    structured, field = structured_from_request(req.response_format, req.structured_outputs, req.model_extra)
    if structured is not None:
        check_compiles(engine, structured, field)
    tok = engine.tokenizer
    prepared = []
    for i, prompt in enumerate(_prompts(req)):
        if isinstance(prompt, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer; send prompt as token ids", param="prompt")
            if rules is not None:
                rules.check_text_length(prompt, engine.max_model_len, "prompt")
            text, ids = prompt, tok.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise APIError(400, f"prompt {i} is empty; it needs at least one token", param="prompt")
        if scores_only(req):
            params = None
            check_context(len(ids), None, engine.max_model_len, "prompt")
        else:
            params = to_sampling_params(req, len(ids), engine.max_model_len, rules)
            params.structured_outputs = structured
        echo = ""
        if req.echo:
            echo = text if text is not None else (tok.decode(ids, skip_special_tokens=False) if tok else "")
        prepared.append(PreparedPrompt(f"{base}-{i}", text, ids, params, echo))
    return base, prepared


Scores = list[list[TokenScore | None] | None]


def _score_top_k(req: CompletionRequest) -> int | None:
    """How many top logprobs the prompt's scores need, or None when nothing asks for them."""
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


async def score_prompts(scorer: PromptScorer, req: CompletionRequest, prepared: list[PreparedPrompt]) -> Scores:
    top_k = _score_top_k(req)
    if top_k is None:
        return [None] * len(prepared)
    return [await scorer.score(p.token_ids, top_k) for p in prepared]


def _usage(prepared: list[PreparedPrompt], outs: list[RequestOutput | None]) -> UsageInfo:
    prompt = sum(len(p.token_ids) for p in prepared)
    completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    cached = PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outs if o is not None))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=cached)


def _echo_part(
    engine: AsyncEngine, req: CompletionRequest, p: PreparedPrompt, scores: list[TokenScore | None] | None
) -> tuple[CompletionLogprobs | None, PromptLogprobs | None]:
    """(the echoed prompt's completion-format logprobs, vLLM's prompt_logprobs) of one prompt."""
    tok = engine.tokenizer
    echo = None
    if req.echo and req.logprobs is not None and scores is not None:
        echo = echo_logprobs(tok, p.token_ids, scores, req.logprobs)
    field = None
    if req.prompt_logprobs is not None and scores is not None:
        field = prompt_logprobs_field(tok, p.token_ids, scores, req.prompt_logprobs)
    return echo, field


def completion_response(
    engine: AsyncEngine,
    req: CompletionRequest,
    response_id: str,
    prepared: list[PreparedPrompt],
    outs: list[RequestOutput | None],
    scores: Scores,
    model: str,
) -> CompletionResponse:
    choices = []
    for i, (p, out) in enumerate(zip(prepared, outs, strict=True)):
        echo_lp, prompt_lp = _echo_part(engine, req, p, scores[i])
        if out is None:  # scored only
            lp = echo_lp if req.logprobs is not None else None
            choices += [
                CompletionChoice(index=i * req.n + j, text=p.echo_text, logprobs=lp, finish_reason="length",
                                 prompt_logprobs=prompt_lp, token_ids=[] if engine.tokenizer is None else None)
                for j in range(req.n)
            ]
            continue
        for c in out.outputs:
            logprobs = None
            if req.logprobs is not None and c.logprobs is not None:
                gen = completion_logprobs(engine.tokenizer, c.token_ids, c.logprobs, req.logprobs,
                                          len(p.echo_text))
                logprobs = gen if echo_lp is None else joined(echo_lp, gen)
            choices.append(
                CompletionChoice(
                    index=i * req.n + c.index,
                    text=p.echo_text + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_lp,
                    token_ids=list(c.token_ids) if engine.tokenizer is None else None,
                )
            )
    return CompletionResponse(id=response_id, model=model, choices=choices, usage=_usage(prepared, outs))


async def completion_stream(
    engine: AsyncEngine,
    req: CompletionRequest,
    response_id: str,
    prepared: list[PreparedPrompt],
    streams: list[RequestStream | None],
    scores: Scores,
    model: str,
) -> AsyncIterator[str]:
    created = int(time.time())
    holdbacks = [0 if p.params is None else stop_holdback(p.params) for p in prepared]
    cursors = [[ChoiceCursor(h) for _ in range(req.n)] for h in holdbacks]
    # text_offset of the next token, counted from the start of the choice's text (the echoed prompt too)
    offsets = [[len(p.echo_text)] * req.n for p in prepared]
    running = [(i, s) for i, s in enumerate(streams) if s is not None]
    last: dict[int, RequestOutput] = {}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        for i, p in enumerate(prepared):  # the echoed prompt (and its logprobs) first
            echo_lp, prompt_lp = _echo_part(engine, req, p, scores[i])
            if not (req.echo or prompt_lp) and p.params is not None:
                continue
            finish = "length" if p.params is None else None
            for j in range(req.n):
                yield _chunk(response_id, created, model, i * req.n + j, p.echo_text, echo_lp, finish,
                             prompt_logprobs=prompt_lp)
        async for k, out in merge_streams([s for _, s in running]):
            i = running[k][0]
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
                    token_ids=d.token_ids if engine.tokenizer is None else None,
                )
        if include_usage:
            outs = [last.get(i) for i in range(len(prepared))]
            yield sse(
                CompletionStreamResponse(
                    id=response_id, created=created, model=model, choices=[], usage=_usage(prepared, outs)
                )
            )
        yield DONE
    except Exception as e:  # headers are sent: report in-band, as OpenAI and vLLM do
        yield sse_error(e)
        yield DONE
    finally:
        for p, s in zip(prepared, streams, strict=True):
            if s is not None and not s.finished:
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
    prompt_logprobs: PromptLogprobs | None = None,
    token_ids: list[int] | None = None,
) -> str:
    choice = CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
        prompt_logprobs=prompt_logprobs, token_ids=token_ids,
    )
    return sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))
