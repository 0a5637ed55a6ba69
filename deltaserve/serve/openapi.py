"""The OpenAPI document as the server really answers: a request that fails validation gets a 400 in
OpenAI's error shape (FastAPI's default document says 422 with its own `detail` shape), and routes behind
the API key can answer 401. /health and /metrics describe their own bodies (empty; Prometheus text)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}
_OPEN_WITH_KEY = ("/health",)
# Statuses beyond 200 / 400 / 401 that a route can answer, and why.
_MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models/{model_id}", "/tokenize",
                 "/detokenize")
_GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_LOOKUP_ROUTES = ("/inspect/api/gdn_state", "/inspect/api/attention", "/inspect/api/vision/request")
_STREAMING_ROUTES = _GENERATION_ROUTES  # "stream": true answers with server-sent events


# One server-sent event of a streamed answer (with stream: true), as SSE parsers (schemathesis's checks
# among them) read it: its data line (a JSON chunk, or [DONE]) and its event type.
SSE_EVENT = {
    "type": "object", "description": "with stream: true: one server-sent event",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def install_openapi(app: FastAPI, api_key: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = ERROR_SCHEMA
        for path, item in doc.get("paths", {}).items():
            for op in item.values():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = _error("Invalid request: the message names the field")
                if api_key and path not in _OPEN_WITH_KEY:
                    responses["401"] = _error("Missing or wrong API key")
                if path in _MODEL_ROUTES:
                    responses["404"] = _error("The model is not the one this server serves")
                if path in _LOOKUP_ROUTES:
                    responses["404"] = _error("The trace or request id is unknown or expired")
                if "requestBody" in op:
                    responses["413"] = _error("The body is larger than --max-request-body-bytes")
                if path in _GENERATION_ROUTES:
                    responses["503"] = _error("The waiting queue is full (Retry-After) or the engine stopped")
                if path in _STREAMING_ROUTES and "200" in responses:
                    responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
