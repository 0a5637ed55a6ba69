"""Chat messages -> prompt text through the model's chat template (chat_template_kwargs such as
enable_thinking go to the template, as in vLLM). The roles are checked by the request model (protocol.py);
`developer` (OpenAI's newer name for the system message) is rendered as `system`, which is what the
Qwen templates know: they would drop a role they do not know without a word."""

from __future__ import annotations

from typing import Any

from deltaserve.engine.media import MediaError, content_parts, render_parts
from deltaserve.serve.errors import APIError
from deltaserve.serve.protocol import ChatMessage


def _parts(content: list[dict[str, Any]], index: int) -> list[tuple[str, Any]]:
    try:
        parts = content_parts(content, f"messages[{index}].content")
    except MediaError as e:
        raise APIError(400, str(e), param="messages") from e
    for j, (kind, _) in enumerate(parts):
        if kind == "image_pil":  # a Python object: only LLM.chat can pass one
            raise APIError(400, f"messages[{index}].content[{j}]: content part type 'image_pil' is not "
                           "supported over HTTP; send an image_url", param="messages")
    return parts


# Each message's content parts, checked (None where the content is a string or absent): parsed once per request.
MessageParts = list[list[tuple[str, Any]] | None]


def message_parts(messages: list[ChatMessage]) -> MessageParts:
    return [_parts(m.content, i) if isinstance(m.content, list) else None for i, m in enumerate(messages)]


def image_urls(parts: MessageParts) -> list[tuple[str, Any]]:
    """(where, url) of every image part, in the order their placeholders appear in the prompt."""
    return [(f"messages[{i}].content[{j}]", url) for i, message in enumerate(parts) for j, (kind, url)
            in enumerate(message or []) if kind == "image_url"]


def render_chat_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    parts: MessageParts | None = None,
) -> str:
    """parts: message_parts(messages) where the caller has them already."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    parts = message_parts(messages) if parts is None else parts
    convo = []
    for m, content in zip(messages, parts, strict=True):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for system; most checkpoints' templates know only system
            d["role"] = "system"
        d["content"] = (render_parts(content) if content is not None else m.content) or ""
        convo.append(d)
    kwargs = dict(chat_template_kwargs or {})
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise APIError(
            400, f"chat_template_kwargs.enable_thinking must be true or false, got {thinking!r}",
            param="chat_template_kwargs",
        )
    for reserved in ("messages", "add_generation_prompt", "tools", "chat_template"):
        if reserved in kwargs:
            raise APIError(
                400, f"chat_template_kwargs may not set {reserved!r}", param="chat_template_kwargs"
            )
    try:
        return tokenizer.apply_chat_template(
            convo, add_generation_prompt=add_generation_prompt, tools=tools or None, **kwargs
        )
    except ValueError as e:  # ChatTemplateError: the template refused this conversation
        raise APIError(
            400, f"the chat template could not render these messages: {e}", param="messages"
        ) from e
