"""Incremental detokenization and stop checking for one output sequence.

Byte-level BPE splits a multi-byte UTF-8 character (most Chinese characters are 3 bytes) across tokens;
decoding such a token alone gives U+FFFD. As vLLM / HF TGI do, the detokenizer keeps two offsets into the
token list: text is decoded over [prefix_offset, end) and compared with the text over
[prefix_offset, read_offset); the difference is emitted only when it does not end in U+FFFD, i.e. once the
character is complete. Starting prefix_offset a few tokens into the prompt gives the decoder the context
some tokenizers need to place leading spaces."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from deltaserve.sampling import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token
# (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids)[-_PROMPT_CONTEXT:]
        self._ids: list[int] = context  # prompt context + output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # everything emitted so far
        self.output_token_ids: list[int] = []

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it completes (possibly "" while a character is
        still incomplete, or several characters once it completes)."""
        self._ids.append(int(token_id))
        self.output_token_ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Emits whatever is still held back (bytes that never completed a character decode to U+FFFD);
        call when the sequence finishes for a reason other than a stop string."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


FinishReason = Literal["stop", "length"]


@dataclass(slots=True)
class StopResult:
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the stop string, or the stop token id; None for EOS / length / running
    text: str  # the output text after any truncation

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def check_stop(
    text: str,
    new_delta_len: int,
    token_id: int,
    num_output_tokens: int,
    params: SamplingParams,
    eos_token_ids: Iterable[int],
) -> StopResult:
    """Decides whether a sequence stops after the token just added. `text` is the full output text
    including the new delta of `new_delta_len` characters; `num_output_tokens` counts the new token.

    Order as vLLM: nothing stops before min_tokens; then EOS (unless ignore_eos) and stop_token_ids, whose
    own text is dropped unless include_stop_str_in_output; then stop strings, searched only where the new
    text could have completed one; then max_tokens."""
    if num_output_tokens < params.min_tokens:
        return StopResult(None, None, text)
    keep_stop = params.include_stop_str_in_output
    if not params.ignore_eos and token_id in set(eos_token_ids):
        return StopResult("stop", None, text if keep_stop else _drop_tail(text, new_delta_len))
    if params.stop_token_ids and token_id in params.stop_token_ids:
        return StopResult("stop", token_id, text if keep_stop else _drop_tail(text, new_delta_len))
    if params.stop and new_delta_len > 0:
        longest = max(len(s) for s in params.stop)
        # A stop string may begin up to longest-1 characters before the new text and end inside it.
        start = max(0, len(text) - new_delta_len - (longest - 1))
        best: tuple[int, str] | None = None
        for s in params.stop:
            idx = text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            return StopResult("stop", s, text[: idx + len(s)] if keep_stop else text[:idx])
    if num_output_tokens >= params.max_tokens:
        return StopResult("length", None, text)
    return StopResult(None, None, text)


def stop_holdback(params: SamplingParams) -> int:
    """How many trailing characters a streaming server should hold back, because they might be the start
    of a stop string that will be cut from the output (vLLM does the same)."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def _drop_tail(text: str, n: int) -> str:
    return text[: len(text) - n] if n > 0 else text
