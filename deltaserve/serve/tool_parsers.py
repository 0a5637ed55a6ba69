"""Tool-call parsers with vLLM's names: `qwen3_coder` (Qwen3.5's XML calls) and `hermes` (Qwen3's JSON
calls), both inside `<tool_call>` ... `</tool_call>`:

    qwen3_coder:  <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
    hermes:       <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>

qwen3_coder values are raw text; each is converted to the JSON type the tool's schema gives its parameter
(a string stays as written; integers, numbers, booleans, null, objects and arrays are decoded).

One streaming implementation serves both modes (the non-streamed result is the stream fed the whole text),
so streamed and non-streamed calls agree by construction. A call is emitted once its block is complete
and parses: first a delta with index, id, type and name, then the arguments in fragments (one per
parameter) whose concatenation is the call's arguments. A block that does not parse stays text."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from deltaserve.serve.reasoning import _partial_tag_tail

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    @property
    def arguments_json(self) -> str:
        return "".join(argument_fragments(self.arguments))

    def to_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments_json}
        return {"id": self.id, "type": "function", "function": fn}


def argument_fragments(arguments: dict[str, Any]) -> list[str]:
    """The arguments' JSON in pieces (`{`, one per key, `}`); joined, exactly json.dumps(arguments)."""
    pieces = ["{"]
    for i, (k, v) in enumerate(arguments.items()):
        key, value = json.dumps(k, ensure_ascii=False), json.dumps(v, ensure_ascii=False)
        pieces.append(f"{', ' if i else ''}{key}: {value}")
    pieces.append("}")
    return pieces


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name -> its parameters schema, from OpenAI's `tools` list."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function") or {}
        if isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


class ToolParser:
    """One call format: how the text between `<tool_call>` and `</tool_call>` reads as a call."""

    name: ClassVar[str]

    def parse_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
        raise NotImplementedError


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


def _string_enum(schema: dict[str, Any] | None) -> bool:
    return bool(schema) and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])


def convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A qwen3_coder parameter's raw text as the JSON value its schema's type asks for (as vLLM's
    qwen3_coder parser: what does not convert stays the string it was)."""
    types = (schema or {}).get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if types == ["string"] or (not types and _string_enum(schema)):
        return raw
    text = raw.strip()
    if "null" in types and text.lower() in ("null", "none"):
        return None
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "integer" in types and re.fullmatch(r"-?\d+", text):
        return int(text)
    if "number" in types:
        try:
            value = float(text)
            return int(value) if re.fullmatch(r"-?\d+", text) else value
        except ValueError:
            pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return raw


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def parse_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
        m = _FUNCTION.fullmatch(block)
        if m is None:
            return None
        name, body = m.group(1).strip(), m.group(2)
        props = (schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        pos = 0
        for p in _PARAMETER.finditer(body):
            if body[pos : p.start()].strip():
                return None  # text between parameters: not this format
            key = p.group(1).strip()
            args[key] = convert_value(p.group(2), props.get(key) if isinstance(props, dict) else None)
            pos = p.end()
        if body[pos:].strip():
            return None
        return ToolCall(name, args)


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], args)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Qwen3CoderToolParser, HermesToolParser)}


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own call format needs (None: the template renders no tool calls)."""
    if not template:
        return None
    if "<function=" in template:
        return Qwen3CoderToolParser.name
    if CALL_START in template:
        return HermesToolParser.name
    return None


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chunk deltas, in order


@dataclass(slots=True)
class StreamingToolParser:
    """Splits the answer (the content after any reasoning) into content and tool calls as it streams.
    Whitespace right before a call (the template's `\\n\\n`) is not content; with parallel_tool_calls
    false only the first call counts."""

    parser: ToolParser
    schemas: dict[str, dict[str, Any]]
    parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _space: str = ""  # whitespace before the block being read

    def feed(self, delta: str, final: bool = False) -> ToolDelta:
        out = ToolDelta()
        self._buf += delta
        while self._buf:
            if not self._buf.startswith(CALL_START):
                start = self._buf.find(CALL_START)
                if start == -1:
                    keep = 0
                    if not final:  # a tag may be starting, and whitespace before a call is not content
                        keep = _partial_tag_tail(self._buf, CALL_START)
                        keep += _trailing_space(self._buf[: len(self._buf) - keep])
                    elif self.calls and not self._buf.strip():
                        self._buf = ""  # whitespace after the last call
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                text = self._buf[:start]
                body = text.rstrip()
                out.content += body
                self._space = text[len(body) :]  # dropped if a call follows, content if the block is text
                self._buf = self._buf[start:]
                continue
            end = self._buf.find(CALL_END)
            if end == -1 and not final:
                break
            block_end = len(self._buf) if end == -1 else end + len(CALL_END)
            inner = self._buf[len(CALL_START) : end if end != -1 else len(self._buf)]
            call = self.parser.parse_block(inner, self.schemas)
            if call is None:
                out.content += self._space + self._buf[:block_end]  # malformed: it stays text
            elif self.parallel or not self.calls:
                self._emit(call, out)
            self._space = ""
            self._buf = self._buf[block_end:]
        return out

    def _emit(self, call: ToolCall, out: ToolDelta) -> None:
        index = len(self.calls)
        self.calls.append(call)
        out.tool_calls.append(
            {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        )
        for piece in argument_fragments(call.arguments):
            out.tool_calls.append({"index": index, "function": {"arguments": piece}})


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip())


def extract_tool_calls(parser: ToolParser, schemas: dict[str, dict[str, Any]], text: str,
                       parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer: the stream fed all of it at once."""
    s = StreamingToolParser(parser, schemas, parallel)
    d = s.feed(text, final=True)
    return d.content, s.calls
