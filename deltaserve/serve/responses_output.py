"""The Responses API's output items, built from the answer's parts in the order they come (reasoning, then
message text and function calls, which may interleave: a call can follow `</think>` directly, text can
follow a call), with the streaming events each part makes, named and shaped as the `openai` package's
openai.types.responses models:

    reasoning:      output_item.added, content_part.added, reasoning_text.delta ..., reasoning_text.done,
                    content_part.done, output_item.done
    message:        the same with output_text.delta / output_text.done
    function_call:  output_item.added (arguments "", status in_progress), function_call_arguments.delta
                    ... (each argument as the tool parser completes it), function_call_arguments.done,
                    output_item.done

Every event carries its sequence_number. The non-streamed response is built by the same code, fed the
whole answer at once, so its items equal the streamed ones (but for their ids)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from deltaserve.serve.chat_tools import ToolPlan
from deltaserve.serve.reasoning import StreamingReasoningParser
from deltaserve.serve.tool_parsers import StreamingToolParser, ToolCall

# What one step of the answer gives after its reasoning, in order (ToolDelta.pieces): a str is content, a
# dict a chat-style call delta (the header has the call's id and name), a ToolCall the end of that call.
Pieces = list[str | dict[str, Any] | ToolCall]


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


@dataclass(slots=True)
class AnswerSplitter:
    """Reasoning, content and calls of one output as it streams (the chat endpoint's parsers); keeps the
    whole of each, which the stored conversation needs."""

    thinking: bool  # the prompt opened a think block
    plan: ToolPlan
    reasoning_parser: StreamingReasoningParser = field(init=False)
    tools: StreamingToolParser | None = field(init=False)
    reasoning: str = ""
    content: str = ""

    def __post_init__(self) -> None:
        self.reasoning_parser = StreamingReasoningParser(self.thinking)
        plan = self.plan
        self.tools = StreamingToolParser(plan.parser, plan.schemas, plan.parallel) if plan.parser else None

    def feed(self, text: str, final: bool) -> tuple[str, Pieces]:
        """(reasoning delta, what follows it)."""
        split = self.reasoning_parser.feed(text, final=final)
        self.reasoning += split.reasoning
        if self.tools is None:
            self.content += split.content
            return split.reasoning, [split.content]
        found = self.tools.feed(split.content, final=final)
        self.content += found.content
        return split.reasoning, found.pieces

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []


# item type -> (new item, the text's delta event, its done event)
_TEXT_ITEMS = {
    "reasoning": (reasoning_item, "response.reasoning_text.delta", "response.reasoning_text.done"),
    "message": (message_item, "response.output_text.delta", "response.output_text.done"),
}


@dataclass(slots=True)
class OutputItems:
    """The output items so far and, when `streaming`, the server-sent events that built them (take_events
    hands them over). Each event is serialized when it is made: the items change after it."""

    streaming: bool
    output: list[dict[str, Any]] = field(default_factory=list)
    _events: list[str] = field(default_factory=list)
    _sequence: int = 0
    _open: dict[str, Any] | None = None  # the item being written

    def event(self, kind: str, **data: Any) -> None:
        if self.streaming:
            body = json.dumps({"type": kind, "sequence_number": self._sequence, **data})
            self._events.append(f"event: {kind}\ndata: {body}\n\n")
            self._sequence += 1

    def take_events(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def feed(self, reasoning: str, pieces: Pieces) -> None:
        """One step of the answer: its reasoning, then its content and call deltas in order."""
        if reasoning:
            self._text("reasoning", reasoning)
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    self._text("message", piece)
            elif isinstance(piece, ToolCall):
                self.close()
            elif "id" in piece:  # a call's header: its item opens
                self.close()
                self._add(call_item(piece["id"], piece["function"]["name"], "", "in_progress"))
            else:
                item = self._open
                assert item is not None and item["type"] == "function_call", "a fragment outside its call"
                item["arguments"] += piece["function"]["arguments"]
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=len(self.output) - 1, delta=piece["function"]["arguments"])

    def close(self) -> None:
        """End the item being written (at the end of the answer, or before another item)."""
        item, self._open = self._open, None
        if item is None:
            return
        i = len(self.output) - 1
        item["status"] = "completed"
        if item["type"] == "function_call":
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                       arguments=item["arguments"])
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            self.event(_TEXT_ITEMS[item["type"]][2], item_id=item["id"], output_index=i, content_index=0,
                       text=part["text"], **extra)
            self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        self.event("response.output_item.done", output_index=i, item=item)

    def _add(self, item: dict[str, Any]) -> None:
        self.output.append(item)
        self._open = item
        added = {**item, "content": []} if "content" in item else item
        self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)

    def _text(self, kind: str, delta: str) -> None:
        if self._open is None or self._open["type"] != kind:
            self.close()
            new, _, _ = _TEXT_ITEMS[kind]
            self._add(new("", "in_progress"))
            assert self._open is not None
            self.event("response.content_part.added", item_id=self._open["id"], output_index=len(self.output) - 1,
                       content_index=0, part=self._open["content"][0])
        item = self._open
        item["content"][0]["text"] += delta
        extra = {"logprobs": []} if kind == "message" else {}
        self.event(_TEXT_ITEMS[kind][1], item_id=item["id"], output_index=len(self.output) - 1, content_index=0,
                   delta=delta, **extra)
