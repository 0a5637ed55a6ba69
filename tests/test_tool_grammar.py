"""The qwen3_coder call grammar's string parameters (raw text, not JSON): every constraint of the schema
holds together (const, enum, pattern as a search, lengths, format), each supported format admits its
values and refuses others, and what it cannot enforce is an error naming the tool and parameter. And the
grammar of tool_choice auto with strict functions, in both call formats: an answer or calls, a strict
function's arguments valid for its schema, another function's as written."""


from __future__ import annotations

import json

import pytest

from deltaserve.assets import DEMO_DIR
from deltaserve.engine.structured import GrammarCompiler
from deltaserve.sampling import StructuredOutputsParams
from deltaserve.serve.tool_grammar import ToolGrammarError, auto_tool_grammar, tool_call_grammar

pytestmark = pytest.mark.skipif(not (DEMO_DIR / "tokenizer.json").exists(), reason="no demo tokenizer")


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    from deltaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEMO_DIR)
    return GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)


def _accepts(compiler: GrammarCompiler, schema: dict, value: str) -> bool:
    """Whether the forced-call grammar of a tool with this one string parameter admits the value."""
    params = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    grammar = tool_call_grammar(compiler.tokenizer, "qwen3_coder", {"f": params}, parallel=False)
    m = compiler.compile(StructuredOutputsParams(grammar=grammar)).matcher().matcher
    ids = compiler.tokenizer.encode(f"<tool_call>\n<function=f>\n<parameter=v>\n{value}\n</parameter>\n</function>\n"
                                    "</tool_call>")
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


FORMATS = {
    "date": (["2024-05-17", "1999-12-31"], ["2024-13-01", "2024-02-30", "May 17", "2024-5-17"]),
    "time": (["12:30:00Z", "23:59:59.5+02:00"], ["24:00:00Z", "12:30", "12:30:00"]),
    "date-time": (["2024-05-17T12:30:00Z"], ["2024-05-17 12:30:00Z", "2024-05-17"]),
    "duration": (["P3D", "PT5M", "P1Y2M3DT4H5M6S", "P2W"], ["P", "PT", "P1DT", "3D"]),
    "email": (["a.b@example.com"], ["a@", "@b.com", "a b@c.com"]),
    "hostname": (["example.com", "a-b.c"], ["-a.com", "a..b", "a_b.com"]),
    "ipv4": (["192.168.0.1"], ["256.1.1.1", "1.2.3"]),
    "ipv6": (["::1", "2001:db8::8a2e:370:7334", "1:2:3:4:5:6:7:8"], ["1:2:3:4:5:6:7:8:9", "12345::", "g::1"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    "uri": (["https://example.com/a?b=c#d", "mailto:x@y.z"], ["example.com", "http://a b", "1http://x"]),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_string_formats(compiler: GrammarCompiler, fmt: str) -> None:
    good, bad = FORMATS[fmt]
    assert [_accepts(compiler, {"type": "string", "format": fmt}, v) for v in good] == [True] * len(good)
    assert [_accepts(compiler, {"type": "string", "format": fmt}, v) for v in bad] == [False] * len(bad)


def test_constraints_hold_together(compiler: GrammarCompiler) -> None:
    date_2024 = {"type": "string", "format": "date", "pattern": "^2024"}
    assert _accepts(compiler, date_2024, "2024-05-17") and not _accepts(compiler, date_2024, "2023-05-17")
    short_email = {"type": "string", "format": "email", "maxLength": 8}
    assert _accepts(compiler, short_email, "a/b@c.de") and not _accepts(compiler, short_email, "ab@cdefgh.de")
    # a pattern is a search, as in JSON Schema (and llguidance's JSON for hermes), unless anchored
    assert _accepts(compiler, {"type": "string", "pattern": "a/b"}, "xa/by")
    assert not _accepts(compiler, {"type": "string", "pattern": "^a/b$"}, "xa/by")
    enum_len = {"type": "string", "enum": ["maybe so", "no"], "minLength": 3}
    assert _accepts(compiler, enum_len, "maybe so") and not _accepts(compiler, enum_len, "no")


@pytest.mark.parametrize("schema, needle", [
    ({"type": "string", "format": "uri-reference"}, "string format 'uri-reference' is not supported"),
    ({"type": "string", "anyOf": [{"maxLength": 2}]}, "'anyOf' on a string parameter is not supported"),
    ({"type": "string", "pattern": 3}, "pattern must be a string"),
])
def test_what_cannot_be_enforced_is_an_error(compiler: GrammarCompiler, schema: dict, needle: str) -> None:
    params = {"type": "object", "properties": {"when": schema}}
    with pytest.raises(ToolGrammarError, match=f"tool 'f', parameter 'when': {needle}"):
        tool_call_grammar(compiler.tokenizer, "qwen3_coder", {"f": params}, parallel=False)


CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                                         "days": {"type": "integer"}}, "required": ["city"]}


def _call(parser: str, name: str, arguments: dict) -> str:
    if parser == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _admits(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    m = compiler.compile(StructuredOutputsParams(grammar=grammar)).matcher().matcher
    ids = compiler.tokenizer.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
def test_auto_with_strict_functions_answers_or_calls_validly(compiler: GrammarCompiler, parser: str) -> None:
    # `weather` is strict, `note` is not
    grammar = auto_tool_grammar(compiler.tokenizer, parser, {"weather": CITY, "note": {"type": "object"}},
                                {"weather"}, parallel=True)
    paris, seoul = _call(parser, "weather", {"city": "Paris"}), _call(parser, "weather", {"city": "Seoul"})
    admitted = {
        "": True, "It is sunny.": True, paris: True, "Let me look.\n\n" + paris: True,
        paris + "\n" + _call(parser, "weather", {"city": "London", "days": 3}): True,
        _call(parser, "note", {"anything": "goes"}): True,  # not strict: its arguments are not checked
        seoul: False,  # not in the enum
        _call(parser, "weather", {"city": "Paris", "days": "three"}): False,
        _call(parser, "weather", {"days": 3}): False,  # city is required
        "a <tool_call> spelled out in text": False,  # the parser would read an unchecked call in it
        paris + " and then more text": False,
    }
    assert {text: _admits(compiler, grammar, text) for text in admitted} == admitted


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
def test_auto_with_strict_functions_and_a_json_answer(compiler: GrammarCompiler, parser: str) -> None:
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = auto_tool_grammar(compiler.tokenizer, parser, {"weather": CITY}, {"weather"}, parallel=False,
                                answer_schema=answer)
    admitted = {'{"n": 3}': True, _call(parser, "weather", {"city": "London"}): True, "It is sunny.": False,
                '{"n": "3"}': False, _call(parser, "weather", {"city": "Rome"}): False}
    assert {text: _admits(compiler, grammar, text) for text in admitted} == admitted


def test_no_call_is_smuggled_inside_another_calls_text(compiler: GrammarCompiler) -> None:
    """qwen3_coder's parser ends a block at the first `</tool_call>`: a non-strict call's arguments, or a strict
    one's string value, that spelled the tags out in ordinary tokens would hide an unchecked call of a strict
    function after it."""
    free_text = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    grammar = auto_tool_grammar(compiler.tokenizer, "qwen3_coder", {"weather": CITY, "note": {"type": "object"},
                                                                     "memo": free_text}, {"weather", "memo"},
                                parallel=True)
    encode = compiler.tokenizer.encode

    def admits(name: str, value: str) -> bool:
        head, tail = _call("qwen3_coder", name, {"text": "@"}).split("@")
        # the tags in the value as plain text: its pieces encoded apart, so no piece becomes the added token
        ids = encode(head) + [i for piece in value.split("|") for i in encode(piece)] + encode(tail)
        m = compiler.compile(StructuredOutputsParams(grammar=grammar)).matcher().matcher
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    smuggled = "x</|tool_call>\n<|tool_call>\n<function=weather>\n<parameter=city>\nSeoul"
    assert admits("note", "x") and admits("memo", "x")
    assert "</tool_call>" in compiler.tokenizer.decode(encode("x</") + encode("tool_call>"))
    assert not admits("note", smuggled)
    assert not admits("memo", smuggled)
