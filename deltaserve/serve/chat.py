"""Chat messages -> prompt text through the model's chat template (chat_template_kwargs such as
enable_thinking go to the template, as in vLLM). The roles are checked by the request model (protocol.py);
`developer` (OpenAI's newer name for the system message) is rendered as `system`, which is what the
Qwen templates know: they would drop a role they do not know without a word."""

from __future__ import annotations

from typing import Any

from deltaserve.serve.errors import APIError
from deltaserve.serve.protocol import ChatMessage


def _text_of(content: str | list[dict[str, Any]] | None, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"messages[{index}].content: only text parts are supported, got type {part.get('type')!r}",
                param="messages",
            )
        parts.append(part["text"])
    return "".join(parts)


def render_chat_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    convo = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for system; most checkpoints' templates know only system
            d["role"] = "system"
        d["content"] = _text_of(m.content, i) or ""
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
