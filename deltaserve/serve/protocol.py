"""Request and response bodies of the OpenAI API (chat completions, completions, models), with vLLM's
extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, chat_template_kwargs, ...).
Unknown request fields are accepted and ignored, as vLLM does, so newer clients keep working; fields
that OpenAI defines but deltaserve cannot honour (suffix, best_of other than n) are refused by name.
Every string in a request must be valid Unicode: a lone UTF-16 surrogate ("\ud800", which JSON allows)
is a 400 naming its field, not a crash in the tokenizer."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from deltaserve.sampling import MAX_LOGPROBS


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def lone_surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string under value (keys too) that is not valid Unicode: a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        children = [(f"{path}.{k}", k) for k in value if isinstance(k, str)]  # the keys themselves
        children += [(f"{path}.{k}", v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None  # numbers, None; nested request models check themselves
    for sub, child in children:
        found = lone_surrogate_at(child, sub)
        if found is not None:
            return found
    return None


class _Request(BaseModel):
    # strict: a value of the wrong JSON type is a 400, not silently coerced ("2" as n, 0 as false, 1.5 as
    # max_tokens); integers still count as numbers.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _valid_unicode(self) -> _Request:
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        for name, value in {**fields, **(self.model_extra or {})}.items():
            found = lone_surrogate_at(value, name)
            if found is not None:
                raise PydanticCustomError(
                    "lone_surrogate",
                    "{field} contains a lone UTF-16 surrogate, which is not valid Unicode text",
                    {"field": found},
                )
        return self


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share; each maps to the SamplingParams field of the same name."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None  # accepted only equal to n (no best-of-n ranking)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM: top-k per prompt token
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured outputs (deltaserve/serve/structured.py): OpenAI's and vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: requests with different salts never share cached prefix blocks (one tenant's prompt cannot be
    # probed by another's timing). It keys the first block's hash (deltaserve/cache/prefix.py).
    cache_salt: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, salt: str | None) -> str | None:
        return check_cache_salt(salt)


def check_cache_salt(salt: str | None) -> str | None:
    if salt is not None and not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")  # vLLM's words
    return salt


def engine_prompt(token_ids: list[int], text: str | None, cache_salt: str | None) -> dict[str, Any]:
    """The prompt as the engine takes it: token ids, the text they came from (if any), the cache salt."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if text is not None:
        prompt["prompt"] = text
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


class FunctionCall(_Request):
    name: str
    # OpenAI sends a JSON string; a JSON object is accepted too (chat templates take either).
    arguments: str | dict[str, Any]


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# `developer` is OpenAI's newer name for `system`; the prompt renders it as system.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_Request):
    role: ChatRole
    # A string, or OpenAI content parts ([{"type": "text", "text": ...}]); None for tool-call turns.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, token ids, or a list of token-id lists (one choice set per prompt).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # here too: scoring needs no SamplingParams
    echo: bool = False
    suffix: str | None = None  # refused when set: no fill-in-the-middle


# ---- responses --------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed, as OpenAI's chunks do.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank, decoded_token}}
# for the token itself and the top-k.
class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None  # with --skip-tokenizer-init (no tokenizer): the output as token ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deltaserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
