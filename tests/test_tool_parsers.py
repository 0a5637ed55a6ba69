"""The tool-call parsers on the real Qwen3.5 (qwen3_coder) and Qwen3 (hermes) formats: types from the
schema, nested JSON, multi-line strings, calls after reasoning, malformed calls, streaming split at
every position giving exactly the non-streamed result, and arguments streamed as they complete."""

from __future__ import annotations

import json

import pytest

from deltaserve.serve.reasoning import StreamingReasoningParser
from deltaserve.serve.tool_parsers import (
    HermesToolParser,
    Qwen3CoderToolParser,
    StreamingToolParser,
    extract_tool_calls,
    parser_for_template,
    tool_schemas,
)

TOOLS = [{"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": "number"},
    "flexible": {"type": "boolean"}, "stops": {"type": "array"}, "prefs": {"type": "object"},
    "note": {"type": "string"}}}}}]
SCHEMAS = tool_schemas(TOOLS)
ARGS = {"city": "Paris", "days": 3, "budget": 12.5, "flexible": True, "stops": [{"a": [1, {"b": None}]}, "x"],
        "prefs": {"food": {"veg": True, "spice": [1, 2]}}, "note": "line one\nline two\n\n  indented"}
QWEN = (
    "<tool_call>\n<function=plan>\n"
    + "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in ARGS.items())
    + "</function>\n</tool_call>"
)
HERMES = '<tool_call>\n{"name": "plan", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>"


@pytest.mark.parametrize("parser, call", [(Qwen3CoderToolParser(), QWEN), (HermesToolParser(), HERMES)])
def test_types_nested_values_and_newlines(parser, call: str) -> None:
    content, calls = extract_tool_calls(parser, SCHEMAS, "Let me plan.\n\n" + call + "\n" + call)
    assert content == "Let me plan."
    assert [c.name for c in calls] == ["plan", "plan"]
    assert json.loads(calls[0].arguments_json) == ARGS
    assert calls[0].arguments_json == json.dumps(ARGS, ensure_ascii=False)
    assert calls[0].id != calls[1].id
    _, one = extract_tool_calls(parser, SCHEMAS, call + "\n" + call, parallel=False)
    assert len(one) == 1


def test_qwen3_coder_keeps_unconvertible_values_as_text() -> None:
    text = (
        "<tool_call>\n<function=plan>\n<parameter=days>\nthree\n</parameter>\n"
        "<parameter=other>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    _, calls = extract_tool_calls(Qwen3CoderToolParser(), SCHEMAS, text)
    assert calls[0].arguments == {"days": "three", "other": 7}


@pytest.mark.parametrize("bad", [
    "<tool_call>\n<function=plan>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # unclosed parameter
    "<tool_call>\nnot a call\n</tool_call>",
    "<tool_call>\n<function=plan>\nstray text<parameter=city>\nP\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=plan>\n<parameter=city>\nParis",  # cut off by max_tokens
])
def test_malformed_call_stays_text(bad: str) -> None:
    content, calls = extract_tool_calls(Qwen3CoderToolParser(), SCHEMAS, "Hi " + bad)
    assert calls == [] and content == "Hi " + bad


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "plan", "arguments": {"city": }\n</tool_call>',
    '<tool_call>\n{"name": "pl\\qan", "arguments": {"city": "P"}}\n</tool_call>',  # not JSON escapes
    '<tool_call>\n{"name": "plan", "arguments": {"ci\\qty": "P"}}\n</tool_call>',
])
def test_hermes_malformed_json_stays_text(bad: str) -> None:
    assert extract_tool_calls(HermesToolParser(), SCHEMAS, bad) == (bad, [])


def _stream(parser, text: str, cuts: list[int], thinking: bool = False) -> tuple[str, str, list[dict]]:
    """Feed text in pieces through the reasoning split and the tool parser, as the chat stream does."""
    reasoning = StreamingReasoningParser(thinking)
    tools = StreamingToolParser(parser, SCHEMAS)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    r_all, c_all, deltas = "", "", []
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        split = reasoning.feed(piece, final=final)
        d = tools.feed(split.content, final=final)
        r_all, c_all = r_all + split.reasoning, c_all + d.content
        deltas += d.tool_calls
    return r_all, c_all, deltas


def _calls_of(deltas: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("parser, call", [(Qwen3CoderToolParser(), QWEN), (HermesToolParser(), HERMES)])
def test_split_at_every_position_equals_whole(parser, call: str) -> None:
    text = "I will check.</think>\n\nSure.\n\n" + call
    whole_content, whole_calls = extract_tool_calls(parser, SCHEMAS, "Sure.\n\n" + call)
    expected = [(c.name, c.arguments_json) for c in whole_calls]
    for cut in range(1, len(text)):
        reasoning, content, deltas = _stream(parser, text, [cut], thinking=True)
        assert (reasoning, content, _calls_of(deltas)) == ("I will check.", whole_content, expected), cut
    # and token-sized pieces everywhere at once
    _, content, deltas = _stream(parser, text, list(range(1, len(text), 3)), thinking=True)
    assert (content, _calls_of(deltas)) == (whole_content, expected)


def test_call_right_after_think_end() -> None:
    text = "need a tool</think>\n\n" + QWEN
    reasoning, content, deltas = _stream(Qwen3CoderToolParser(), text, [len("need a tool</think>")], thinking=True)
    assert reasoning == "need a tool" and content == "" and _calls_of(deltas)[0][0] == "plan"


def test_parser_follows_the_template() -> None:
    assert parser_for_template("{{- '<tool_call>\\n<function=' + name }}") == "qwen3_coder"
    assert parser_for_template('<tool_call>\\n{"name": <function-name>}') == "hermes"
    assert parser_for_template("{{ messages }}") is None


def _arrivals(parser, text: str) -> tuple[list[tuple[int, dict]], str]:
    """Feed text one character at a time: (position fed when each delta came, the content)."""
    tools = StreamingToolParser(parser, SCHEMAS)
    arrivals, content = [], ""
    for i in range(len(text)):
        d = tools.feed(text[i], final=i == len(text) - 1)
        arrivals += [(i + 1, delta) for delta in d.tool_calls]
        content += d.content
    return arrivals, content


@pytest.mark.parametrize("parser, call", [(Qwen3CoderToolParser(), QWEN), (HermesToolParser(), HERMES)])
def test_arguments_stream_as_they_complete(parser, call: str) -> None:
    """The header, then each argument the moment it is complete, long before the block ends; at every
    moment the arguments sent so far are a prefix of the final ones."""
    arrivals, content = _arrivals(parser, call)
    assert content == ""
    expected = json.dumps(ARGS, ensure_ascii=False)
    assert "".join(d["function"]["arguments"] for _, d in arrivals) == expected
    header = arrivals[0][1]
    assert header["id"] and header["function"] == {"name": "plan", "arguments": ""}
    members = [(at, d["function"]["arguments"]) for at, d in arrivals[1:] if d["function"]["arguments"] not in "{}"]
    assert [m for _, m in members] == [f"{', ' if i else ''}{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                                       for i, (k, v) in enumerate(ARGS.items())]
    # each argument arrives on its own, right after its text is complete (qwen3_coder: its </parameter>;
    # hermes: the comma or brace after its value), and the first before the block ends
    ends = ([call.index("</parameter>", call.index(f"<parameter={k}>")) + len("</parameter>") for k in ARGS]
            if isinstance(parser, Qwen3CoderToolParser) else None)
    if ends is not None:
        assert [at for at, _ in members] == ends
    assert len({at for at, _ in members}) == len(ARGS)
    assert arrivals[0][0] == members[0][0] < members[-1][0] < len(call) == arrivals[-1][0]


@pytest.mark.parametrize("text, args, rest", [
    ("<tool_call>\n<function=plan>\n<parameter=city>\nParis\n</parameter>\nstray\n</function>\n</tool_call>",
     {"city": "Paris"}, "\nstray\n</function>\n</tool_call>"),
    ("<tool_call>\n<function=plan>\n<parameter=city>\nParis\n</parameter>\n<parameter=city>\nLima\n</parameter>\n"
     "</function>\n</tool_call>", {"city": "Paris"},
     "\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>"),  # a repeated argument
    ("<tool_call>\n<function=plan>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3",
     {"city": "Paris"}, "\n<parameter=days>\n3"),  # cut off by max_tokens
])
def test_call_broken_after_an_argument_keeps_what_was_sent(text: str, args: dict, rest: str) -> None:
    """Sent arguments cannot be taken back: the call ends with them, the unread rest is content, and the
    non-streamed result is the same."""
    parser = Qwen3CoderToolParser()
    content, calls = extract_tool_calls(parser, SCHEMAS, text)
    assert (content, [(c.name, c.arguments) for c in calls]) == (rest, [("plan", args)])
    for cut in range(1, len(text)):
        _, c, deltas = _stream(parser, text, [cut])
        assert (c, _calls_of(deltas)) == (rest, [("plan", json.dumps(args))]), cut


def test_hermes_other_layouts_are_read_whole() -> None:
    """Keys in another order, or the arguments as a JSON string: one call when the block ends."""
    for block in ['{"arguments": {"days": 2}, "name": "plan"}', '{"name": "plan", "arguments": "{\\"days\\": 2}"}']:
        text = f"<tool_call>\n{block}\n</tool_call>"
        assert [(c.name, c.arguments) for c in extract_tool_calls(HermesToolParser(), SCHEMAS, text)[1]] == [
            ("plan", {"days": 2})]
        for cut in range(1, len(text)):
            _, content, deltas = _stream(HermesToolParser(), text, [cut])
            assert (content, _calls_of(deltas)) == ("", [("plan", '{"days": 2}')]), cut
