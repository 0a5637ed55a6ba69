"""tool_choice `required` and named functions, enforced by constrained decoding: a Lark grammar (llguidance)
that admits exactly the calls the parser reads, in the parser's format, with arguments valid for each
tool's parameters schema (required parameters always, optional ones may be left out).

qwen3_coder writes values as raw text: a string parameter is free text that cannot contain the
`\\n</parameter>\\n` closing it (its enum, const, pattern, minLength and maxLength are kept); any other type
is JSON for its schema. hermes writes the arguments as one JSON object for the parameters schema. Both
admit the declared parameters only (a schema that says additionalProperties otherwise keeps it in hermes)."""

from __future__ import annotations

import json
import re
from typing import Any

from deltaserve.engine.structured import json_schema_lark, lark_text
from deltaserve.serve.tool_parsers import CALL_END, CALL_START, HermesToolParser

_PARAM_END = "\n</parameter>\n"


class ToolGrammarError(ValueError):
    """A tool's schema this grammar cannot enforce; the message names the tool and parameter."""


def _string_value_regex(schema: dict[str, Any]) -> str:
    """The regex of a string parameter's raw value (before its closing tag)."""
    if "const" in schema:
        return re.escape(str(schema["const"]))
    if "enum" in schema:
        return "(" + "|".join(re.escape(str(e)) for e in schema["enum"]) + ")"
    if "pattern" in schema:
        p = schema["pattern"]
        return p[1:] if p.startswith("^") else p  # the value is matched whole
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None or hi is not None:
        return f"(?s:.{{{int(lo or 0)},{'' if hi is None else int(hi)}}})"
    return "(?s:.*)"


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
            value = _string_value_regex(schema)
            # The value and its closing tag are one lexeme, so where the value ends is never ambiguous.
            rules.append(
                f"{term}: /{value}\\n<\\/parameter>\\n/ & ~/(?s:.*)\\n<\\/parameter>\\n(?s:.+)/"
            )
            body = f"{opener} {term}"
        else:
            body = f"{opener} {json_schema_lark(schema)} {json.dumps(_PARAM_END)}"
        rules.append(f"p_{idx}_{k}: {body}")
        parts.append(f"p_{idx}_{k}" + ("" if key in required else "?"))
    head = (
        f"{lark_text(tokenizer, CALL_START)} {json.dumps(chr(10) + '<function=' + name + '>' + chr(10))} "
        f"{' '.join(parts)} \"</function>\\n\" {lark_text(tokenizer, CALL_END)}"
    )
    return [f"call_{idx}: {head}", *rules]


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


def tool_call_grammar(tokenizer: Any, parser_name: str, schemas: dict[str, dict[str, Any]],
                      parallel: bool) -> str:
    """A Lark grammar for one call (or, with parallel, one or more) of the functions in `schemas`."""
    build = _hermes_call if parser_name == HermesToolParser.name else _qwen3_coder_call
    rules: list[str] = []
    names: list[str] = []
    for idx, (name, params) in enumerate(schemas.items()):
        rules += build(tokenizer, name, params, idx)
        names.append(f"call_{idx}")
    call = "call: " + " | ".join(names)
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, call, *rules]) + "\n"
