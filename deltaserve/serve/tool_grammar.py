"""tool_choice `required` and named functions, and strict functions under `auto`, enforced by constrained
decoding: a Lark grammar (llguidance) that admits exactly the calls the parser reads, in the parser's format,
with arguments valid for each tool's parameters schema (required parameters always, optional ones may be left
out); under auto, free text (or the response_format's JSON) may come instead of or before the calls.

qwen3_coder writes values as raw text: a string parameter is free text that cannot contain the
`\\n</parameter>\\n` closing it, and meets all of its const, enum, pattern, minLength, maxLength and format
(the formats llguidance's JSON schemas support, as raw-text regexes here: a string's value is not quoted
JSON, so llguidance's own do not apply); a keyword it cannot enforce is an error. Any other type is JSON
for its schema. hermes writes the arguments as one JSON object for the parameters schema. Both
admit the declared parameters only (a schema that says additionalProperties otherwise keeps it in hermes)."""

from __future__ import annotations

import json
import re
from typing import Any

from deltaserve.engine.structured import json_schema_lark, lark_text, llguidance_module
from deltaserve.serve.tool_parsers import CALL_END, CALL_START, HermesToolParser

_PARAM_END = "\n</parameter>\n"
# Free text inside a call never spells out a call tag: the parser ends a block at the first </tool_call>, so a
# value or loose arguments holding "</tool_call>\n<tool_call>..." would smuggle in a call the grammar never
# checked.
_NO_CALL_TAG = "~/(?s:.*)<\\/?tool_call>(?s:.*)/"


class ToolGrammarError(ValueError):
    """A tool's schema this grammar cannot enforce; the message names the tool and parameter."""


_HEX4 = "[0-9a-fA-F]{1,4}"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DATE = ("[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         "|02-(0[1-9]|1[0-9]|2[0-8]))")  # (February 29th left out: which years have one is no regex's)
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_HOSTNAME = f"{_LABEL}(\\.{_LABEL})*"
# Each a subset of its format's values (so what the grammar lets through always validates), in the syntax
# llguidance's regexes take (no lookaround; & and ~ are Lark's, below).
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    # at least one part, and a T only before a time part
    "duration": ("P([0-9]+W|([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)(T_)?|T_)"
                 .replace("T_", "T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S)")),
    "email": f"[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+(\\.[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+)*@{_HOSTNAME}",
    "hostname": _HOSTNAME,
    "ipv4": "((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "ipv6": "|".join([
        f"({_HEX4}:){{7}}{_HEX4}", f"({_HEX4}:){{1,7}}:", f"({_HEX4}:){{1,6}}:{_HEX4}",
        *(f"({_HEX4}:){{1,{6 - k}}}(:{_HEX4}){{1,{k + 1}}}" for k in range(1, 6)),
        f":((:{_HEX4}){{1,7}}|:)",
    ]),
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": "[A-Za-z][A-Za-z0-9+.-]*:([A-Za-z0-9._~:/?#@!$&'()*+,;=\\[\\]-]|%[0-9A-Fa-f]{2})+",
}
# Keywords that constrain a string and that this grammar cannot enforce (annotations and unknown
# keywords are ignored, as JSON Schema says)
_UNENFORCEABLE = ("allOf", "anyOf", "oneOf", "not", "$ref", "if", "then", "else", "contentSchema")


def _string_value_regexes(where: str, schema: dict[str, Any]) -> list[str]:
    """Regexes a string parameter's raw value must match, all of them (before its closing tag)."""
    for keyword in _UNENFORCEABLE:
        if keyword in schema:
            raise ToolGrammarError(f"{where}: {keyword!r} on a string parameter is not supported")
    out = []
    if "const" in schema:
        out.append(re.escape(str(schema["const"])))
    if "enum" in schema:
        out.append("(" + "|".join(re.escape(str(e)) for e in schema["enum"]) + ")")
    if "pattern" in schema:
        p = schema["pattern"]
        if not isinstance(p, str):
            raise ToolGrammarError(f"{where}: pattern must be a string")
        # A search, as JSON Schema's (and llguidance's, for hermes): free text where it is not anchored
        anchored_start = p.startswith("^")
        anchored_end = p.endswith("$") and not p.endswith("\\$")
        core = p[1 if anchored_start else 0 : len(p) - 1 if anchored_end else len(p)]
        out.append(f"{'' if anchored_start else '(?s:.*)'}(?:{core}){'' if anchored_end else '(?s:.*)'}")
    if "format" in schema:
        fmt = schema["format"]
        if fmt not in _FORMATS:
            raise ToolGrammarError(f"{where}: string format {fmt!r} is not supported; the supported ones are "
                                   + ", ".join(_FORMATS))
        out.append(_FORMATS[fmt])
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None or hi is not None:
        out.append(f"(?s:.{{{int(lo or 0)},{'' if hi is None else int(hi)}}})")
    return out or ["(?s:.*)"]


def _is_string(schema: dict[str, Any]) -> bool:
    t = schema.get("type")
    if t == "string":
        return True
    return t is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])


def _qwen3_coder_call(tokenizer: Any, name: str, params: dict[str, Any], idx: int) -> list[str]:
    """Lark rules for one function's call; the first rule is the call."""
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    unknown = required - set(props)
    if unknown:
        raise ToolGrammarError(f"tool {name!r}: required parameter {sorted(unknown)[0]!r} has no schema")
    rules: list[str] = []
    parts: list[str] = []
    for k, (key, schema) in enumerate(props.items()):
        schema = schema if isinstance(schema, dict) else {}
        opener = json.dumps(f"<parameter={key}>\n")
        if _is_string(schema):
            term = f"STR_{idx}_{k}"
            values = _string_value_regexes(f"tool {name!r}, parameter {key!r}", schema)
            # The value and its closing tag are one lexeme, so where the value ends is never ambiguous; it
            # meets every constraint (Lark's & of regexes).
            ends = [f"/{llguidance_module().regex_to_lark(f'(?:{v})')}\\n<\\/parameter>\\n/" for v in values]
            rules.append(f"{term}: {' & '.join(ends)} & ~/(?s:.*)\\n<\\/parameter>\\n(?s:.+)/ & {_NO_CALL_TAG}")
            body = f"{opener} {term}"
        else:
            body = f"{opener} {json_schema_lark(schema)} {json.dumps(_PARAM_END)}"
        rules.append(f"p_{idx}_{k}: {body}")
        parts.append(f"p_{idx}_{k}" + ("" if key in required else "?"))
    tail = f"\"</function>\\n\" {lark_text(tokenizer, CALL_END)}"
    return [f"call_{idx}: {_qwen3_coder_head(tokenizer, name)} {' '.join(parts)} {tail}", *rules]


def _qwen3_coder_head(tokenizer: Any, name: str) -> str:
    """A qwen3_coder call's opening: the call tag and the function's name."""
    return f"{lark_text(tokenizer, CALL_START)} {json.dumps(chr(10) + '<function=' + name + '>' + chr(10))}"


def _hermes_call(tokenizer: Any, name: str, params: dict[str, Any], idx: int) -> list[str]:
    prefix = json.dumps("\n" + json.dumps({"name": name})[:-1] + ', "arguments": ')
    schema = dict(params or {"type": "object"})
    if "properties" in schema and "additionalProperties" not in schema:
        # The declared parameters only, as the qwen3_coder grammar: free extra keys are never a useful call.
        schema["additionalProperties"] = False
    return [
        f"call_{idx}: {lark_text(tokenizer, CALL_START)} {prefix} {json_schema_lark(schema)} "
        f"\"}}\\n\" {lark_text(tokenizer, CALL_END)}"
    ]


def _loose_call(tokenizer: Any, parser_name: str, name: str, idx: int) -> list[str]:
    """A call of a function that is not strict, under tool_choice auto: its name, then arguments in the
    parser's layout that are not checked against its schema (as without any grammar)."""
    if parser_name == HermesToolParser.name:
        return _hermes_call(tokenizer, name, {"type": "object"}, idx)
    # The arguments and the closing tag are one lexeme, as a string value is (_qwen3_coder_call)
    return [f"call_{idx}: {_qwen3_coder_head(tokenizer, name)} ARGS_{idx} {lark_text(tokenizer, CALL_END)}",
            f"ARGS_{idx}: /(?s:.*)<\\/function>\\n/ & ~/(?s:.*)<\\/function>\\n(?s:.+)/ & {_NO_CALL_TAG}"]


def _call_rules(tokenizer: Any, parser_name: str, schemas: dict[str, dict[str, Any]],
                loose: frozenset[str] = frozenset()) -> list[str]:
    """The rule `call` (one call of any function in `schemas`) and the rules it needs; the functions named
    in `loose` get unchecked arguments, the others arguments valid for their schema."""
    build = _hermes_call if parser_name == HermesToolParser.name else _qwen3_coder_call
    rules: list[str] = []
    names: list[str] = []
    for idx, (name, params) in enumerate(schemas.items()):
        if name in loose:
            rules += _loose_call(tokenizer, parser_name, name, idx)
        else:
            rules += build(tokenizer, name, params, idx)
        names.append(f"call_{idx}")
    return ["call: " + " | ".join(names), *rules]


def tool_call_grammar(tokenizer: Any, parser_name: str, schemas: dict[str, dict[str, Any]],
                      parallel: bool) -> str:
    """A Lark grammar for one call (or, with parallel, one or more) of the functions in `schemas`."""
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, *_call_rules(tokenizer, parser_name, schemas)]) + "\n"


def auto_tool_grammar(tokenizer: Any, parser_name: str, schemas: dict[str, dict[str, Any]], strict: set[str],
                      parallel: bool, answer_schema: dict[str, Any] | bool | None = None) -> str:
    """tool_choice auto with strict functions (OpenAI's `"strict": true`): the model may answer or call, as
    it likes, but a call of a strict function always has arguments valid for its schema. The answer is free
    text that never spells out the call tag (else the parser would read an unchecked call in it), followed by
    any calls; with answer_schema (the request's response_format) it is that JSON value instead, and then
    the output is the answer or the calls."""
    calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
    loose = frozenset(schemas) - frozenset(strict)
    if answer_schema is None:
        tag = llguidance_module().regex_to_lark(re.escape(CALL_START))
        answer = ["start: TEXT? calls?", f"TEXT: /(?s:.+)/ & ~/(?s:.*){tag}(?s:.*)/"]
    else:
        answer = ["start: answer | calls", f"answer: {json_schema_lark(answer_schema)}"]
    return "\n".join([*answer, calls, *_call_rules(tokenizer, parser_name, schemas, loose)]) + "\n"
