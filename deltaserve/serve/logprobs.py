"""Engine logprobs ({token id: logprob} per generated token, top-N plus the chosen token) in OpenAI's two
formats: chat (`content: [{token, logprob, bytes, top_logprobs}]`) and legacy completions
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); and prompt logprobs (serve/scoring.py) in the
completions format (echo) and in vLLM's `prompt_logprobs` format."""

from __future__ import annotations

from typing import Any

from deltaserve.serve.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from deltaserve.serve.scoring import TokenScore


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


def echo_logprobs(
    tokenizer: Any, token_ids: list[int], scores: list[TokenScore | None], top_k: int
) -> CompletionLogprobs:
    """The echoed prompt's part of a completion's logprobs: the first token has none (nothing predicts it)."""
    out = CompletionLogprobs()
    offset = 0
    for tid, s in zip(token_ids, scores, strict=True):
        text = _token_text(tokenizer, tid)
        out.tokens.append(text)
        out.token_logprobs.append(None if s is None else s.logprob)
        top = None
        if s is not None and top_k:
            top = {_token_text(tokenizer, t): v for t, v in list(s.top.items())[:top_k]}
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def joined(first: CompletionLogprobs, second: CompletionLogprobs | None) -> CompletionLogprobs:
    if second is None:
        return first
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def prompt_logprobs_field(
    tokenizer: Any, token_ids: list[int], scores: list[TokenScore | None], top_k: int
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}
    for the token itself and the top-k."""
    out: PromptLogprobs = []
    for tid, s in zip(token_ids, scores, strict=True):
        if s is None:
            out.append(None)
            continue
        entry = {tid: PromptLogprob(logprob=s.logprob, rank=s.rank, decoded_token=_token_text(tokenizer, tid))}
        for rank, (t, v) in enumerate(list(s.top.items())[:top_k], start=1):
            if t != tid:
                entry[t] = PromptLogprob(logprob=v, rank=rank, decoded_token=_token_text(tokenizer, t))
        out.append(entry)
    return out
