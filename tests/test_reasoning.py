"""The Qwen3-style reasoning parser: whole-text and streamed splits agree however the text is cut into
deltas, including `</think>` cut across deltas."""

from __future__ import annotations

import pytest

from deltaserve.serve.reasoning import StreamingReasoningParser, split_reasoning, thinking_open


def stream_split(text: str, cuts: list[int], thinking: bool = True) -> tuple[str, str]:
    parser = StreamingReasoningParser(thinking)
    bounds = [0, *cuts, len(text)]
    reasoning = content = ""
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        d = parser.feed(text[a:b], final=i == len(bounds) - 2)
        reasoning += d.reasoning
        content += d.content
    return reasoning, content


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("I add them.</think>\n\n5", "I add them.", "5"),
        ("<think>\nhmm</think>\n\nok</think>", "\nhmm", "ok</think>"),  # a re-emitted <think> is dropped
        ("no end yet </thi", "no end yet </thi", ""),  # cut by max_tokens: all reasoning
        ("</think>\n\n\nanswer\n", None, "answer\n"),
        ("a < b </think>c", "a < b ", "c"),
    ],
)
def test_split_whole_and_every_two_cuts(text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, True) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert stream_split(text, [i, j]) == (reasoning or "", content), (i, j)


def test_one_character_deltas() -> None:
    text = "step one\nstep two</think>\n\nThe answer is 5."
    assert stream_split(text, list(range(1, len(text)))) == ("step one\nstep two", "The answer is 5.")


def test_thinking_disabled_means_no_reasoning() -> None:
    text = "plain answer </think> with a tag"
    assert split_reasoning(text, False) == (None, text)
    assert stream_split(text, [3, 15], thinking=False) == ("", text)


def test_thinking_open_reads_the_rendered_prompt() -> None:
    assert thinking_open("<|im_start|>assistant\n<think>\n")
    assert not thinking_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not thinking_open("<|im_start|>assistant\n")
