"""Qwen3-style reasoning parser: the chat template opens `<think>` in the generation prompt and the model
closes it, so the output is `reasoning</think>\\n\\nanswer`. Text before the first `</think>` is
reasoning_content, text after it is content (leading newlines dropped). An output that never closes the
block (cut by max_tokens) is all reasoning. When thinking is off the template renders an empty, closed
block, and the output is all content.

One streaming implementation serves both modes (the non-streaming result is the stream fed the whole text
at once), so streamed and non-streamed splits agree by construction. The stream holds back a tail that
could be the start of `</think>` (or of a re-emitted `<think>`), so a tag split across deltas is still
found and never leaks into either field."""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def thinking_open(prompt: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` block open for the model to close; this is what
    enable_thinking (or any other template switch) decided, read from the prompt itself."""
    start = prompt.rfind(THINK_START)
    return start != -1 and start > prompt.rfind(THINK_END)


def _partial_tag_tail(text: str, tag: str) -> int:
    """Length of the longest proper suffix of text that is a prefix of tag (a tag possibly cut off)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


@dataclass(slots=True)
class StreamingReasoningParser:
    in_reasoning: bool  # True when the prompt opened a think block
    _buf: str = ""
    _seen_start: bool = False  # past the point where the model could re-emit `<think>`
    _content_started: bool = False

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        """Split the next piece of output text; final=True at the end flushes anything held back."""
        if not self.in_reasoning:
            return ReasoningDelta(content=self._content(delta))
        buf = self._buf + delta
        if not self._seen_start:
            # Some models repeat the `<think>` the prompt already opened: drop it.
            if THINK_START.startswith(buf) and len(buf) < len(THINK_START) and not final:
                self._buf = buf
                return ReasoningDelta()
            if buf.startswith(THINK_START):
                buf = buf[len(THINK_START) :]
            self._seen_start = True
        end = buf.find(THINK_END)
        if end != -1:
            self.in_reasoning = False
            self._buf = ""
            return ReasoningDelta(buf[:end], self._content(buf[end + len(THINK_END) :]))
        keep = 0 if final else _partial_tag_tail(buf, THINK_END)
        self._buf = buf[len(buf) - keep :] if keep else ""
        return ReasoningDelta(reasoning=buf[: len(buf) - keep])

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")  # the template's `</think>\n\n` separator is not part of the answer
            self._content_started = bool(text)
        return text


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole output; reasoning_content is None when empty."""
    d = StreamingReasoningParser(thinking).feed(text, final=True)
    return d.reasoning or None, d.content
