"""POST /v1/chat/completions: messages -> prompt, one engine request with n sequences, the answer split
into reasoning_content, content and tool_calls, streamed as chat.completion.chunk events or returned
whole."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deltaserve.engine.async_engine import AsyncEngine, RequestStream
from deltaserve.engine.detokenizer import stop_holdback
from deltaserve.engine.image_processor import ImageError
from deltaserve.engine.media import MediaError, MediaOptions, load_image
from deltaserve.engine.multimodal import MultiModalError, check_image_limit
from deltaserve.outputs import RequestOutput
from deltaserve.sampling import SamplingParams
from deltaserve.serve.chat import MessageParts, image_urls, message_parts, render_chat_prompt
from deltaserve.serve.chat_tools import ToolConfig, ToolPlan, plan_tools
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
    PromptTokensDetails,
    UsageInfo,
    engine_prompt,
    random_id,
)
from deltaserve.serve.reasoning import THINK_END, StreamingReasoningParser, split_reasoning, thinking_open
from deltaserve.serve.scoring import TokenScore
from deltaserve.serve.streaming import DONE, ChoiceCursor, sse, sse_error
from deltaserve.serve.structured import check_compiles, structured_from_request
from deltaserve.serve.tool_parsers import StreamingToolParser, extract_tool_calls


@dataclass(slots=True)
class PreparedChat:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    thinking: bool
    tools: ToolPlan
    images: list[Any] = field(default_factory=list)  # decoded pictures of the image_url parts, in order

    def engine_prompt(self, cache_salt: str | None = None) -> dict[str, Any]:
        prompt = engine_prompt(self.prompt_token_ids, self.prompt, cache_salt)
        if self.images:
            prompt["multi_modal_data"] = {"image": self.images}
        return prompt


def prepare_chat(
    engine: AsyncEngine, req: ChatCompletionRequest, tool_config: ToolConfig | None = None,
    rules: RequestRules | None = None, media: MediaOptions | None = None, parts: MessageParts | None = None,
) -> PreparedChat:
    """Template, tokenize, fetch the images and check one request: run it off the event loop. parts:
    message_parts(req.messages) where the caller has them already."""
    parts = message_parts(req.messages) if parts is None else parts
    if req.stream and req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not supported with stream on chat completions; use "
                       "stream: false or /v1/completions", param="prompt_logprobs")
    structured, field = structured_from_request(req.response_format, req.structured_outputs, req.model_extra)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tool_config or ToolConfig(),
                       engine.tokenizer, structured)
    if structured is not None and tools.structured is not None and not tools.answer_constrained:
        raise APIError(400, f"tool_choice {tools.choice!r} cannot be combined with {field}", param=field)
    if tools.structured is not None:
        if tools.answer_constrained:  # the response_format's own schema: a 400 about it names its field
            check_compiles(engine, structured, field)
        structured, field = tools.structured, "tools"
    prompt = render_chat_prompt(
        engine.tokenizer, req.messages, req.add_generation_prompt, req.chat_template_kwargs, req.tools, parts
    )
    thinking = thinking_open(prompt)
    if rules is not None:
        rules.check_text_length(prompt, engine.max_model_len, "messages")
    ids = engine.tokenizer.encode(prompt)
    params = to_sampling_params(req, len(ids), engine.max_model_len, rules)
    if structured is not None:
        if thinking:  # the reasoning stays free; the constraint starts after it
            structured = dataclasses.replace(structured, reasoning_end=THINK_END)
        check_compiles(engine, structured, field)
        params.structured_outputs = structured
    images = _images(engine, image_urls(parts), media or MediaOptions())
    return PreparedChat(random_id("chatcmpl"), prompt, ids, params, thinking, tools, images)


def _images(engine: AsyncEngine, urls: list[tuple[str, Any]], media: MediaOptions) -> list[Any]:
    if not urls:
        return []
    core = engine.engine
    if core.encoder_cache is None:  # before any fetch: the model could not use them anyway
        raise APIError(400, "this model has no vision tower (its checkpoint has no model.visual.* tensors or no "
                       "vision_config), so it cannot take image_url parts", param="messages")
    try:
        check_image_limit(len(urls), (core.config.limit_mm_per_prompt or {}).get("image"))
    except MultiModalError as e:
        raise APIError(400, str(e), param="messages") from e
    images = []
    for where, url in urls:
        try:  # resized and cut into patches here, off the engine's thread
            images.append(core.image_processor(load_image(url, where, media)))
        except (MediaError, ImageError) as e:
            raise APIError(400, f"{e}" if isinstance(e, MediaError) else f"{where}: {e}", param="messages") from e
    return images


def _usage(out: RequestOutput) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=completion,
        total_tokens=len(out.prompt_token_ids) + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
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
        tool_calls: list[dict] = []
        finish_reason = c.finish_reason
        if prep.tools.parser is not None:
            content, calls = extract_tool_calls(prep.tools.parser, prep.tools.schemas, content, prep.tools.parallel)
            tool_calls = [call.to_openai() for call in calls]
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if (prep.thinking or tool_calls) and not content:
            content = None  # still thinking when it stopped, or only calls: there is no answer text
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            logprobs = chat_logprobs(engine.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
        choices.append(
            ChatCompletionChoice(
                index=c.index,
                message=ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls),
                logprobs=logprobs,
                finish_reason=finish_reason,
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
    plan = prep.tools
    tool_parsers = [
        StreamingToolParser(plan.parser, plan.schemas, plan.parallel) if plan.parser is not None else None
        for _ in range(n)
    ]
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
                final = d.finish_reason is not None
                split = parsers[c.index].feed(d.text, final=final)
                tp = tool_parsers[c.index]
                finish_reason = d.finish_reason
                if tp is not None:
                    found = tp.feed(split.content, final=final)
                    split.content = found.content
                    for call_delta in found.tool_calls:  # each call: its header, then argument fragments
                        yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(tool_calls=[call_delta]))])
                    if tp.calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
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
                    index=c.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
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
