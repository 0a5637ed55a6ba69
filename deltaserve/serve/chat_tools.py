"""A chat request's tools: checks `tools` and `tool_choice` as vLLM does, picks the parser, and for
`required` or a named function builds the grammar that forces a valid call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deltaserve.sampling import StructuredOutputsParams
from deltaserve.serve.errors import APIError
from deltaserve.serve.tool_grammar import ToolGrammarError, auto_tool_grammar, tool_call_grammar
from deltaserve.serve.tool_parsers import TOOL_PARSERS, ToolParser, tool_schemas


@dataclass(slots=True)
class ToolConfig:
    """The server's flags: --enable-auto-tool-choice, and --tool-call-parser (else the template's own)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass(slots=True)
class ToolPlan:
    parser: ToolParser | None  # None: the output is not searched for calls (no tools, or tool_choice none)
    schemas: dict[str, dict[str, Any]]
    parallel: bool
    choice: str  # "none", "auto", "required" or "named"
    # required / named: the grammar of a valid call; auto with strict functions: an answer or calls, a
    # strict function's arguments valid for its schema
    structured: StructuredOutputsParams | None = None
    answer_constrained: bool = False  # the grammar includes the request's response_format


def _check_tools(tools: list[dict[str, Any]]) -> None:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise APIError(400, f"tools[{i}].function.strict must be true or false", param="tools")


def strict_functions(tools: list[dict[str, Any]]) -> set[str]:
    """The names of the functions whose spec says `"strict": true`."""
    return {t["function"]["name"] for t in tools if t["function"].get("strict") is True}


def _answer_schema(answer: StructuredOutputsParams | None) -> dict[str, Any] | bool | None:
    """The JSON schema of a response_format that stands beside strict tools under auto."""
    if answer is None:
        return None
    if answer.json_object:
        return {"type": "object"}
    if answer.json is None:  # regex, choice or grammar: vLLM's structured_outputs
        raise APIError(400, "strict tools with tool_choice auto combine with a JSON response_format only, not "
                       "with structured_outputs' regex, choice or grammar", param="structured_outputs")
    if isinstance(answer.json, str):
        try:
            return json.loads(answer.json)
        except json.JSONDecodeError as e:
            raise APIError(400, f"the JSON schema is not valid JSON: {e}", param="structured_outputs") from e
    return answer.json


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel: bool,
               config: ToolConfig, tokenizer: Any, answer: StructuredOutputsParams | None = None) -> ToolPlan:
    """How a request's tools are rendered, parsed and enforced. answer: the request's own structured-output
    constraint (response_format), which strict tools under auto fold into their grammar."""
    if tools:
        _check_tools(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                400, "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )
        named, choice = fn["name"], "named"
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                       param="tool_choice")
    schemas = tool_schemas(tools)
    if choice == "none":
        return ToolPlan(None, schemas, parallel, "none")
    if not tools:
        raise APIError(400, f"tool_choice {choice if named is None else named!r} needs tools", param="tool_choice")
    parser_name = config.tool_call_parser
    if choice == "auto" and not config.enable_auto_tool_choice:
        raise APIError(
            400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
            "(the parser defaults to the one the chat template's call format needs)", param="tool_choice",
        )
    if parser_name is None:
        raise APIError(
            400, "this server has no tool-call parser (its chat template renders no tool calls); "
            "start it with --tool-call-parser", param="tool_choice",
        )
    parser = TOOL_PARSERS[parser_name]()
    if choice == "auto":
        strict = strict_functions(tools)
        if not strict:
            return ToolPlan(parser, schemas, parallel, "auto")
        try:
            grammar = auto_tool_grammar(tokenizer, parser_name, schemas, strict, parallel,
                                        _answer_schema(answer))
        except ToolGrammarError as e:
            raise APIError(400, str(e), param="tools") from e
        return ToolPlan(parser, schemas, parallel, "auto", StructuredOutputsParams(grammar=grammar),
                        answer_constrained=answer is not None)
    if named is not None:
        if named not in schemas:
            raise APIError(400, f"tool_choice names function {named!r}, which is not in tools", param="tool_choice")
        forced = {named: schemas[named]}
        parallel = False  # a named choice is one call of that function, as OpenAI's
    else:
        forced = schemas
    try:
        grammar = tool_call_grammar(tokenizer, parser_name, forced, parallel)
    except ToolGrammarError as e:
        raise APIError(400, str(e), param="tools") from e
    return ToolPlan(parser, schemas, parallel, choice, StructuredOutputsParams(grammar=grammar))
