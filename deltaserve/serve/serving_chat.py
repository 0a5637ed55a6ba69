"""POST /v1/chat/completions: messages -> prompt, one engine request with n sequences, the answer split
into reasoning_content and content, streamed as chat.completion.chunk events or returned whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deltaserve.engine.async_engine import AsyncEngine, RequestStream
from deltaserve.engine.detokenizer import stop_holdback
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams
from deltaserve.serve.chat import render_chat_prompt
from deltaserve.serve.errors import APIError
from deltaserve.serve.logprobs import chat_logprobs, prompt_logprobs_field
from deltaserve.serve.params import RequestRules, to_sampling_params
from deltaserve.serve.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from deltaserve.serve.reasoning import StreamingReasoningParser, split_reasoning, thinking_open
from deltaserve.serve.scoring import TokenScore
from deltaserve.serve.streaming import DONE, ChoiceCursor, sse, sse_error


@dataclass(slots=True)
class PreparedChat:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    thinking: bool


def prepare_chat(
    engine: AsyncEngine, req: ChatCompletionRequest, rules: RequestRules | None = None
) -> PreparedChat:
    """Template, tokenize and check one request: run it off the event loop."""
    if req.stream and req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not supported with stream on chat completions; use "
                       "stream: false or /v1/completions", param="prompt_logprobs")
    prompt = render_chat_prompt(
        engine.tokenizer, req.messages, req.add_generation_prompt, req.chat_template_kwargs
    )
    if rules is not None:
        rules.check_text_length(prompt, engine.max_model_len, "messages")
    ids = engine.tokenizer.encode(prompt)
    params = to_sampling_params(req, len(ids), engine.max_model_len, rules)
    return PreparedChat(random_id("chatcmpl"), prompt, ids, params, thinking_open(prompt))


def _usage(out: RequestOutput) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=completion,
        total_tokens=len(out.prompt_token_ids) + completion,
    )


def chat_response(
    engine: AsyncEngine,
    req: ChatCompletionRequest,
    prep: PreparedChat,
    out: RequestOutput,
    model: str,
    prompt_scores: list[TokenScore | None] | None = None,
) -> ChatCompletionResponse:
    choices = []
    for c in out.outputs:
        reasoning, content = split_reasoning(c.text, prep.thinking)
        if prep.thinking and not content:
            content = None  # still thinking when it stopped: there is no answer yet
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            logprobs = chat_logprobs(engine.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
        choices.append(
            ChatCompletionChoice(
                index=c.index,
                message=ChatResponseMessage(content=content, reasoning_content=reasoning),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    prompt_logprobs = None
    if prompt_scores is not None and req.prompt_logprobs is not None:
        prompt_logprobs = prompt_logprobs_field(
            engine.tokenizer, prep.prompt_token_ids, prompt_scores, req.prompt_logprobs
        )
    return ChatCompletionResponse(
        id=prep.request_id, model=model, choices=choices, usage=_usage(out), prompt_logprobs=prompt_logprobs
    )


async def chat_stream(
    engine: AsyncEngine, req: ChatCompletionRequest, prep: PreparedChat, stream: RequestStream, model: str
) -> AsyncIterator[str]:
    created = int(time.time())
    n = prep.params.n
    cursors = [ChoiceCursor(stop_holdback(prep.params)) for _ in range(n)]
    parsers = [StreamingReasoningParser(prep.thinking) for _ in range(n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        c = ChatCompletionChunk(id=prep.request_id, created=created, model=model, choices=choices)
        if usage is not None:
            c.usage = usage
        return sse(c)

    try:
        for i in range(n):
            yield chunk(
                [
                    ChatStreamChoice(
                        index=i,
                        delta=DeltaMessage(role="assistant", content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                ]
            )
        last: RequestOutput | None = None
        async for out in stream:
            last = out
            for c in out.outputs:
                d = cursors[c.index].advance(c)
                if d is None:
                    continue
                split = parsers[c.index].feed(d.text, final=d.finish_reason is not None)
                if not (
                    split.reasoning or split.content or d.finish_reason or (req.logprobs and d.token_ids)
                ):
                    continue
                delta = DeltaMessage()
                if split.reasoning:
                    delta.reasoning_content = split.reasoning
                if split.content:
                    delta.content = split.content
                logprobs = None
                if req.logprobs and d.logprobs:
                    logprobs = chat_logprobs(engine.tokenizer, d.token_ids, d.logprobs, req.top_logprobs or 0)
                choice = ChatStreamChoice(
                    index=c.index, delta=delta, logprobs=logprobs, finish_reason=d.finish_reason
                )
                if d.finish_reason is not None:
                    choice.stop_reason = c.stop_reason
                yield chunk([choice], _usage(out) if continuous else None)
        if include_usage and last is not None:
            yield chunk([], _usage(last))
        yield DONE
    except Exception as e:  # headers are sent: report in-band, as OpenAI and vLLM do
        yield sse_error(e)
        yield DONE
    finally:
        if not stream.finished:  # the client went away (or the server is stopping): free the cache now
            engine.abort(prep.request_id)
