"""The Responses API's output items and streaming events, from the real parsers (the reasoning parser and
qwen3_coder) fed an answer in the Qwen3.5 format piece by piece: every event validates as the `openai`
package's own event type, a call's arguments stream as each one completes, the items come in the answer's
order (a call right after `</think>`, text after a broken call), and the streamed items equal the whole."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from deltaserve.serve.chat_tools import ToolPlan
from deltaserve.serve.responses_output import AnswerSplitter, OutputItems
from deltaserve.serve.tool_parsers import Qwen3CoderToolParser

EVENTS: TypeAdapter = TypeAdapter(ResponseStreamEvent)
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
CITY = "<parameter=city>\nParis\n</parameter>\n"
CALL = f"<tool_call>\n<function=get_weather>\n{CITY}<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
ARGUMENTS = json.dumps({"city": "Paris", "days": 3})


def _stream(text: str, thinking: bool = False, step: int = 1) -> tuple[list[tuple[int, dict]], list[dict]]:
    """Every event with how many characters had been fed when it came, and the output items, the text fed
    `step` characters at a time."""
    splitter = AnswerSplitter(thinking, ToolPlan(Qwen3CoderToolParser(), SCHEMAS, True, "auto"))
    items = OutputItems(streaming=True)
    events = []
    for start in range(0, len(text), step):
        end = min(start + step, len(text))
        items.feed(*splitter.feed(text[start:end], final=end == len(text)))
        if end == len(text):
            items.close()
        for sse in items.take_events():
            kind, data = sse.split("\n")[:2]
            event = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            events.append((end, event))
    return events, items.output


def _whole(text: str, thinking: bool = False) -> list[dict]:
    splitter = AnswerSplitter(thinking, ToolPlan(Qwen3CoderToolParser(), SCHEMAS, True, "auto"))
    items = OutputItems(streaming=False)
    items.feed(*splitter.feed(text, final=True))
    items.close()
    assert items.take_events() == []
    return items.output


def _without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def _check_events(events: list[dict]) -> None:
    """Each event is the openai package's type for it (validated, not just constructed); numbered in order."""
    for i, e in enumerate(events):
        parsed = EVENTS.validate_python(e)
        assert parsed.type == e["type"] and parsed.sequence_number == i


def test_call_arguments_stream_as_each_completes() -> None:
    timed, output = _stream(CALL)
    events = [e for _, e in timed]
    _check_events(events)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.output_item.added"] + ["response.function_call_arguments.delta"] * 4 + [
        "response.function_call_arguments.done", "response.output_item.done"]
    added, done = events[0]["item"], events[-1]["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather" and added["call_id"]
    assert added["arguments"] == "" and added["status"] == "in_progress"
    deltas = [(at, e["delta"]) for at, e in timed if e["type"] == "response.function_call_arguments.delta"]
    # the header and the first argument as soon as it is complete, the second when it is, `}` at the end
    first_done = CALL.index(CITY) + len(CITY) - 1
    assert deltas == [(first_done, "{"), (first_done, '"city": "Paris"'),
                      (CALL.index("\n</function>"), ', "days": 3'), (len(CALL), "}")]
    assert "".join(d for _, d in deltas) == ARGUMENTS == events[-2]["arguments"] == done["arguments"]
    assert all(e["item_id"] == added["id"] and e["output_index"] == 0 for e in events[1:-1])
    assert done["status"] == "completed" and done["id"] == added["id"] and output == [done]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_call_right_after_think(step: int) -> None:
    text = "I should look it up.\n</think>\n\n" + CALL
    timed, output = _stream(text, thinking=True, step=step)
    events = [e for _, e in timed]
    _check_events(events)
    assert [o["type"] for o in output] == ["reasoning", "function_call"]
    assert output[0]["content"][0]["text"] == "I should look it up.\n" and output[1]["arguments"] == ARGUMENTS
    kinds = [(e["type"], e.get("output_index")) for e in events]
    # the reasoning item is done before the call's item is added, and the call's events name index 1
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1))
    assert [k for k in kinds if k[0].startswith("response.reasoning_text")][-1] == ("response.reasoning_text.done", 0)
    assert all(i == 1 for k, i in kinds if k.startswith("response.function_call_arguments"))
    assert _without_ids(output) == _without_ids(_whole(text, thinking=True))


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_text_then_call_then_text_of_a_broken_block(step: int) -> None:
    """Text before a call is a message item before it; a block that breaks after its first argument ends
    its call with that argument, and the rest of the block is a message after it."""
    broken = f"<tool_call>\n<function=get_weather>\n{CITY}oops</tool_call>"
    text = "Let me check.\n\n" + broken
    timed, output = _stream(text, step=step)
    events = [e for _, e in timed]
    _check_events(events)
    assert [o["type"] for o in output] == ["message", "function_call", "message"]
    assert output[0]["content"][0]["text"] == "Let me check."
    assert output[1]["arguments"] == json.dumps({"city": "Paris"})
    assert output[2]["content"][0]["text"] == "\noops</tool_call>"
    # each item is done before the next is added
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2]
    order = [(e["type"], e["output_index"]) for e in events if e["type"].startswith("response.output_item")]
    assert order == [(f"response.output_item.{k}", i) for i in range(3) for k in ("added", "done")]
    assert _without_ids(output) == _without_ids(_whole(text))
