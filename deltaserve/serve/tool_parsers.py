"""Tool-call parsers with vLLM's names: `qwen3_coder` (Qwen3.5's XML calls) and `hermes` (Qwen3's JSON
calls), both inside `<tool_call>` ... `</tool_call>`:

    qwen3_coder:  <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
    hermes:       <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>

qwen3_coder values are raw text; each is converted to the JSON type the tool's schema gives its parameter
(a string stays as written; integers, numbers, booleans, null, objects and arrays are decoded).

One streaming implementation serves both modes (the non-streamed result is the stream fed the whole text),
so streamed and non-streamed calls agree by construction. A call streams as it is generated: once its
first argument is complete (or, without arguments, once its block is), a delta with index, id, type and
name, then `{` and that argument, then each further argument the moment it is complete (as vLLM's
qwen3_coder parser does, a value streams once whole: its JSON type is known only then), then `}` when
the block ends. The fragments joined are exactly the call's arguments (json.dumps of them).

A block that goes wrong before its first argument is complete stays text. One that goes wrong after it
(text between arguments, a repeated argument, no proper end) cannot take back what was sent: its call
ends with the arguments read so far, and the rest of the block is content."""

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
    return ["{", *(_member_fragment(i, k, v) for i, (k, v) in enumerate(arguments.items())), "}"]


def _member_fragment(i: int, key: str, value: Any) -> str:
    """Argument number i as json.dumps writes it inside the object (after `{`)."""
    return f"{', ' if i else ''}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


@dataclass(slots=True)
class BlockScan:
    """What a call block's text (between `<tool_call>` and `</tool_call>`, possibly still growing) gives so
    far. Only complete pieces count, so a longer text never changes what a shorter one gave."""

    name: str | None = None  # None until the function's name is complete
    members: list[tuple[str, Any]] = field(default_factory=list)  # complete arguments, in order, no repeats
    members_end: int = 0  # where the text after the last complete argument starts
    complete: bool = False  # the text after the arguments is the block's proper end


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

    def scan(self, block: str, schemas: dict[str, dict[str, Any]]) -> BlockScan:
        """The call's name and complete arguments so far, in the format's usual layout."""
        raise NotImplementedError

    def parse_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
        """The whole block as a call, or None when it is not one."""
        scan = self.scan(block, schemas)
        if scan.name is None or not scan.complete:
            return None
        return ToolCall(scan.name, dict(scan.members))


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_FUNCTION_END = re.compile(r"\s*</function>\s*")


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

    def scan(self, block: str, schemas: dict[str, dict[str, Any]]) -> BlockScan:
        m = _FUNCTION.match(block)
        if m is None:
            return BlockScan()
        out = BlockScan(name=m.group(1).strip(), members_end=m.end())
        props = (schemas.get(out.name) or {}).get("properties") or {}
        props = props if isinstance(props, dict) else {}
        seen: set[str] = set()
        while (p := _PARAMETER.match(block, out.members_end)) is not None:
            key = p.group(1).strip()
            if key in seen:
                break  # a repeated argument: not a call's arguments
            seen.add(key)
            out.members.append((key, convert_value(p.group(2), props.get(key))))
            out.members_end = p.end()
        out.complete = _FUNCTION_END.fullmatch(block, out.members_end) is not None
        return out


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')
_JSON_KEY = re.compile(r'\s*("(?:[^"\\]|\\.)*")\s*:\s*')
_HERMES_END = re.compile(r"\s*\}\s*\}\s*")
_COMMA = re.compile(r"\s*,")
_JSON = json.JSONDecoder()


def _json_string(quoted: str) -> str | None:
    """A quoted JSON string's value; None if its escapes are not JSON's."""
    try:
        return json.loads(quoted)
    except json.JSONDecodeError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, block: str, schemas: dict[str, dict[str, Any]]) -> BlockScan:
        """Streams `{"name": NAME, "arguments": {...}}` (the template's layout) argument by argument;
        any other layout is read whole when its block ends (parse_block)."""
        m = _HERMES_HEAD.match(block)
        name = None if m is None else _json_string(m.group(1))
        if m is None or name is None:
            return BlockScan()
        out = BlockScan(name=name, members_end=m.end())
        seen: set[str] = set()
        while True:
            pos = out.members_end
            if out.members:
                comma = _COMMA.match(block, pos)
                if comma is None:
                    break
                pos = comma.end()
            k = _JSON_KEY.match(block, pos)
            if k is None:
                break
            try:
                value, end = _JSON.raw_decode(block, k.end())
            except json.JSONDecodeError:
                break  # not complete yet, or not JSON
            after = block[end:].lstrip()
            key = _json_string(k.group(1))
            # A number is complete only when something follows it; a repeated key is not a call's arguments
            if not after or after[0] not in ",}" or key is None or key in seen:
                break
            seen.add(key)
            out.members.append((key, value))
            out.members_end = end
        out.complete = _HERMES_END.fullmatch(block, out.members_end) is not None
        return out

    def parse_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
        call = ToolParser.parse_block(self, block, schemas)
        if call is not None:
            return call
        try:  # another layout: keys in another order, the arguments as a JSON string
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
    """What one feed gave: content and chat-style call deltas, and both in the order they came (`pieces`:
    a str is content, a dict a call delta, a ToolCall the end of that call), for an API whose items
    interleave (the Responses API's message and function_call items)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chunk deltas, in order
    pieces: list[str | dict[str, Any] | ToolCall] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        if text:
            self.content += text
            self.pieces.append(text)

    def add_call_delta(self, delta: dict[str, Any]) -> None:
        self.tool_calls.append(delta)
        self.pieces.append(delta)


@dataclass(slots=True)
class StreamingToolParser:
    """Splits the answer (the content after any reasoning) into content and tool calls as it streams.
    Whitespace right before a call (the template's `\\n\\n`) is not content; with parallel_tool_calls
    false only the first call counts. `calls` holds the calls whose blocks have ended."""

    parser: ToolParser
    schemas: dict[str, dict[str, Any]]
    parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _space: str = ""  # whitespace before the block being read
    _open: ToolCall | None = None  # the call being streamed (its block has not ended)

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
                    out.add_content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                text = self._buf[:start]
                body = text.rstrip()
                out.add_content(body)
                self._space = text[len(body) :]  # dropped if a call follows, content if the block is text
                self._buf = self._buf[start:]
                continue
            end = self._buf.find(CALL_END)
            inner = self._buf[len(CALL_START) : end if end != -1 else len(self._buf)]
            counts = self.parallel or not self.calls  # (with parallel false, later calls are dropped)
            scan = self.parser.scan(inner, self.schemas)
            if counts and scan.members:
                self._stream(scan, out)
            if end == -1 and not final:
                break
            block_end = len(self._buf) if end == -1 else end + len(CALL_END)
            if self._open is not None:
                self._close(out)
                if not scan.complete:  # what was sent stays a call; the block's unread rest is content
                    out.add_content(self._buf[len(CALL_START) + scan.members_end : block_end])
            else:
                call = self.parser.parse_block(inner, self.schemas)
                if call is None:
                    out.add_content(self._space + self._buf[:block_end])  # malformed: it stays text
                elif counts:
                    self._open = call
                    out.add_call_delta(self._header(call))
                    for fragment in argument_fragments(call.arguments)[:-1]:  # (the "}" is _close's)
                        out.add_call_delta(self._fragment(fragment))
                    self._close(out)
            self._space = ""
            self._buf = self._buf[block_end:]
        return out

    def _stream(self, scan: BlockScan, out: ToolDelta) -> None:
        """Send the arguments the block has completed since the last feed (the call's header first)."""
        assert scan.name is not None
        if self._open is None:
            self._open = ToolCall(scan.name, {})
            out.add_call_delta(self._header(self._open))
            out.add_call_delta(self._fragment("{"))
        args = self._open.arguments
        for i in range(len(args), len(scan.members)):
            key, value = scan.members[i]
            args[key] = value
            out.add_call_delta(self._fragment(_member_fragment(i, key, value)))

    def _header(self, call: ToolCall) -> dict[str, Any]:
        return {"index": len(self.calls), "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}

    def _fragment(self, text: str) -> dict[str, Any]:
        return {"index": len(self.calls), "function": {"arguments": text}}

    def _close(self, out: ToolDelta) -> None:
        assert self._open is not None
        out.add_call_delta(self._fragment("}"))
        out.pieces.append(self._open)
        self.calls.append(self._open)
        self._open = None


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip())


def extract_tool_calls(parser: ToolParser, schemas: dict[str, dict[str, Any]], text: str,
                       parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer: the stream fed all of it at once."""
    s = StreamingToolParser(parser, schemas, parallel)
    d = s.feed(text, final=True)
    return d.content, s.calls
