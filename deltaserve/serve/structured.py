"""Structured-output request fields -> StructuredOutputsParams: OpenAI's `response_format` (json_object,
json_schema, text) and vLLM's `structured_outputs` (choice, regex, json, grammar, json_object). Each is
compiled here once, so a bad schema or grammar is a 400 that names the field and the problem."""

from __future__ import annotations

from typing import Any

from deltaserve.engine.structured import GrammarError
from deltaserve.sampling import StructuredOutputsParams
from deltaserve.serve.errors import APIError

_STRUCTURED_FIELDS = ("choice", "regex", "json", "grammar", "json_object")
# vLLM's older request fields for the same, still sent by some clients
_GUIDED_FIELDS = {f"guided_{k}": k for k in ("json", "regex", "choice", "grammar")}


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        # strict or not, the schema is enforced: constrained decoding cannot produce anything else.
        return StructuredOutputsParams(json=spec["schema"])
    raise APIError(
        400, f"response_format.type must be text, json_object or json_schema, got {kind!r}", param="response_format"
    )


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(so) - set(_STRUCTURED_FIELDS))
    if unknown:
        raise APIError(
            400,
            f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(_STRUCTURED_FIELDS)})",
            param="structured_outputs",
        )
    try:
        return StructuredOutputsParams(**{k: so[k] for k in _STRUCTURED_FIELDS if k in so})
    except ValueError as e:
        raise APIError(400, str(e), param="structured_outputs") from e


def structured_from_request(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
    extra: dict[str, Any] | None = None,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field it came from) of a request; both fields at once is a 400. extra: the
    request's unknown fields, where vLLM's older guided_json / guided_regex / ... may be."""
    guided = {v: extra[k] for k, v in _GUIDED_FIELDS.items() if extra and extra.get(k) is not None}
    if guided:
        if structured_outputs is not None:
            raise APIError(400, "give structured_outputs or guided_*, not both", param="structured_outputs")
        structured_outputs = guided
    if response_format is not None and structured_outputs is not None:
        rf = _from_response_format(response_format)
        if rf is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    if structured_outputs is not None:
        return _from_structured_outputs(structured_outputs), "structured_outputs"
    if response_format is not None:
        return _from_response_format(response_format), "response_format"
    return None, None


def check_compiles(engine: Any, spec: StructuredOutputsParams, param: str) -> None:
    """Compile once on the server side, so the error names the request field."""
    grammars = getattr(getattr(engine, "engine", None), "grammars", None)
    if grammars is None:
        return
    try:
        grammars.compile(spec)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e
