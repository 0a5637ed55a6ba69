"""Engine logprobs ({token id: logprob} per generated token, top-N plus the chosen token) in OpenAI's two
formats: chat (`content: [{token, logprob, bytes, top_logprobs}]`) and legacy completions
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from typing import Any

from deltaserve.serve.protocol import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:k]


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]], top_k: int
) -> ChatChoiceLogprobs:
    content = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        text = _token_text(tokenizer, tid)
        tops = []
        for t, v in _top(lp, top_k):
            s = _token_text(tokenizer, t)
            tops.append(TopLogprob(token=s, logprob=v, bytes=list(s.encode())))
        content.append(
            ChatTokenLogprob(
                token=text, logprob=lp.get(tid, -9999.0), bytes=list(text.encode()), top_logprobs=tops
            )
        )
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]], top_k: int, start_offset: int = 0
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = start_offset
    for tid, lp in zip(token_ids, logprobs, strict=False):
        text = _token_text(tokenizer, tid)
        out.tokens.append(text)
        out.token_logprobs.append(lp.get(tid))
        out.top_logprobs.append({_token_text(tokenizer, t): v for t, v in _top(lp, top_k)} if top_k else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out
