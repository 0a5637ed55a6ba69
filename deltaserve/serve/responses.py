"""POST /v1/responses (OpenAI's Responses API) on top of the chat path: the input items become chat
messages (instructions first, as a system message; function_call / function_call_output items as an
assistant tool call and a tool message; reasoning items as the next assistant turn's reasoning), the chat
template renders them, and the answer comes back as output items: reasoning, message (output_text) and
function_call, whole or as the API's streaming events (responses_output.py builds both).

previous_response_id continues a stored response: the server keeps the conversations of its last
MAX_STORED_RESPONSES responses (store=true, the default) in memory, oldest dropped first, and nothing
across restarts; an id it no longer has is a 400 saying so. As OpenAI does, a new request's instructions
replace the stored ones.

What is not supported is refused with a 400 naming it: built-in tools (web search, files, ...),
background, conversation, prompt templates, include, top_logprobs. reasoning.effort "none" turns thinking off, any
other effort leaves it on (the template has no effort levels)."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from deltaserve.engine.async_engine import AsyncEngine, RequestStream
from deltaserve.engine.detokenizer import stop_holdback
from deltaserve.outputs import RequestOutput
from deltaserve.serve.chat_tools import ToolConfig
from deltaserve.serve.errors import APIError
from deltaserve.serve.params import RequestRules
from deltaserve.serve.protocol import ChatCompletionRequest, check_cache_salt
from deltaserve.serve.responses_output import AnswerSplitter, OutputItems
from deltaserve.serve.serving_chat import PreparedChat, prepare_chat
from deltaserve.serve.streaming import ChoiceCursor, sse_error
from deltaserve.serve.tool_parsers import ToolCall

MAX_STORED_RESPONSES = 512
_UNSUPPORTED = ("background", "conversation", "prompt", "include", "max_tool_calls")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's; as in chat completions

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: str | None) -> str | None:
        return check_cache_salt(salt)


@dataclass(slots=True)
class ResponseStore:
    """The last MAX_STORED_RESPONSES conversations, by response id (messages in chat form)."""

    limit: int = MAX_STORED_RESPONSES
    _items: OrderedDict[str, list[dict[str, Any]]] = field(default_factory=OrderedDict)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = messages
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]]:
        if response_id not in self._items:
            raise APIError(
                400, f"Previous response with id {response_id!r} not found (this server keeps its last "
                f"{self.limit} stored responses in memory)", param="previous_response_id",
            )
        self._items.move_to_end(response_id)
        return list(self._items[response_id])


@dataclass(slots=True)
class PreparedResponse:
    response_id: str
    body: ResponsesRequest
    chat: PreparedChat
    messages: list[dict[str, Any]]  # the conversation so far, without instructions (what is stored)
    created_at: int = field(default_factory=lambda: int(time.time()))


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}: only text content is supported, got {kind!r}", param="input")
        parts.append(part.get("text", ""))
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        # Calls and reasoning join the assistant turn right before them, or open one.
        nonlocal reasoning
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
        return messages[-1]

    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               param="input")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                m = assistant()
                m["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        elif kind == "function_call":
            m = assistant()
            m.setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            })
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported", param="input")
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported, got {t.get('type')!r}",
                           param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":  # flat in the Responses API, nested in chat's
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def prepare_response(engine: AsyncEngine, body: ResponsesRequest, tool_config: ToolConfig,
                     store: ResponseStore, rules: RequestRules | None = None) -> PreparedResponse:
    """The request as the chat request it becomes, prepared as chat requests are (the server's rules:
    generation_config defaults, the prompt-length check)."""
    extra = body.model_extra or {}
    for name in _UNSUPPORTED:
        if extra.get(name) is not None:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if extra.get("top_logprobs"):  # OpenAI's field; 0 (or null) asks for nothing
        raise APIError(400, "top_logprobs is not supported on /v1/responses by this server; use "
                       "/v1/chat/completions with logprobs and top_logprobs", param="top_logprobs")
    if body.truncation not in (None, "disabled"):
        raise APIError(400, "truncation must be 'disabled' (the server does not drop input)", param="truncation")
    messages = store.get(body.previous_response_id) if body.previous_response_id else []
    messages += input_messages(body.input)
    kwargs = dict(body.chat_template_kwargs or {})
    effort = (body.reasoning or {}).get("effort")
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    sampling = {k: extra[k] for k in ("seed", "top_k", "min_p", "repetition_penalty", "stop") if k in extra}
    try:
        chat = ChatCompletionRequest(
            model=body.model, messages=system + messages, max_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, tools=_chat_tools(body.tools),
            tool_choice=_chat_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
            response_format=_response_format(body.text), chat_template_kwargs=kwargs or None, **sampling,
        )
    except ValidationError as e:  # the request's own fields, as the chat request they become (a client's mistake)
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        name = "input" if where.startswith("messages") else where.split(".")[0]
        raise APIError(400, f"{name}: {first['msg']} (as {where} of the chat request it becomes)",
                       param=name) from None
    prep = prepare_chat(engine, chat, tool_config, rules)
    return PreparedResponse(f"resp_{uuid.uuid4().hex}", body, prep, messages)


# ---- output ---------------------------------------------------------------------------------------------
def _response(prep: PreparedResponse, model: str, output: list[dict[str, Any]], status: str,
              out: RequestOutput | None) -> dict[str, Any]:
    b = prep.body
    prompt = len(out.prompt_token_ids) if out is not None else 0
    completion = len(out.outputs[0].token_ids) if out is not None else 0
    return {
        "id": prep.response_id, "object": "response", "created_at": prep.created_at, "model": model,
        "status": status, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": b.instructions, "metadata": b.metadata or {}, "parallel_tool_calls": b.parallel_tool_calls,
        "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
        "previous_response_id": b.previous_response_id, "tool_choice": b.tool_choice or "auto",
        "tools": b.tools or [], "text": b.text or {"format": {"type": "text"}}, "store": b.store,
        "reasoning": b.reasoning, "truncation": "disabled", "user": b.user,
        "usage": None if out is None else {
            "input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
            # cache_write_tokens: required by the openai package's ResponseUsage; the prefix cache's writes
            # are not counted
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _remember(prep: PreparedResponse, store: ResponseStore, reasoning: str, content: str,
              calls: list[ToolCall]) -> None:
    if not prep.body.store:
        return
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        turn["reasoning_content"] = reasoning
    if calls:
        turn["tool_calls"] = [c.to_openai() for c in calls]
    store.put(prep.response_id, [*prep.messages, turn])


def response_object(prep: PreparedResponse, out: RequestOutput, model: str, store: ResponseStore) -> dict[str, Any]:
    s = AnswerSplitter(prep.chat.thinking, prep.chat.tools)
    items = OutputItems(streaming=False)
    items.feed(*s.feed(out.outputs[0].text, final=True))
    items.close()
    _remember(prep, store, s.reasoning, s.content, s.calls)
    status = "incomplete" if out.outputs[0].finish_reason == "length" else "completed"
    return _response(prep, model, items.output, status, out)


async def response_stream(engine: AsyncEngine, prep: PreparedResponse, stream: RequestStream, model: str,
                          store: ResponseStore) -> AsyncIterator[str]:
    """The Responses API's server-sent events: created, in_progress, then per output item added /
    deltas / done as the answer streams (a call's arguments one by one, as the tool parser completes
    them), then completed (with the whole response, equal to the non-streamed one)."""
    s = AnswerSplitter(prep.chat.thinking, prep.chat.tools)
    items = OutputItems(streaming=True)
    cursor = ChoiceCursor(stop_holdback(prep.chat.params))
    try:
        items.event("response.created", response=_response(prep, model, [], "in_progress", None))
        items.event("response.in_progress", response=_response(prep, model, [], "in_progress", None))
        for e in items.take_events():
            yield e
        last: RequestOutput | None = None
        async for out in stream:
            last = out
            d = cursor.advance(out.outputs[0])
            if d is None:
                continue
            items.feed(*s.feed(d.text, final=d.finish_reason is not None))
            for e in items.take_events():
                yield e
        items.close()
        assert last is not None
        _remember(prep, store, s.reasoning, s.content, s.calls)
        status = "incomplete" if last.outputs[0].finish_reason == "length" else "completed"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        items.event(kind, response=_response(prep, model, items.output, status, last))
        for e in items.take_events():
            yield e
    except Exception as e:  # headers are sent: report in-band
        yield sse_error(e)
    finally:
        if not stream.finished:
            engine.abort(prep.chat.request_id)
