"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}, with the HTTP status a
client's SDK maps to the right exception (400 BadRequestError, 401 AuthenticationError, 404 NotFound...)."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

# OpenAI's error "type" per status; the SDK reads the status, people read the type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


@dataclass(slots=True)
class APIError(Exception):
    """Raised by a handler; the app turns it into the error response."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None  # e.g. Retry-After on a 503 for a full queue

    def __str__(self) -> str:
        return self.message


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status) or ("invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": printable(message), "type": kind, "param": param, "code": code}}


def printable(text: str) -> str:
    """text that encodes as UTF-8: a lone surrogate a client sent (and an error message quotes) is written
    as its escape, so that the error itself can be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def from_api_error(e: APIError) -> JSONResponse:
    response = error_response(e.status, e.message, e.param, e.code)
    response.headers.update(e.headers or {})
    return response


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def param_of(message: str, fields: tuple[str, ...]) -> str | None:
    """The request field a validation message is about (SamplingParams' messages start with its name)."""
    head = message.split(" ", 1)[0].strip(":,")
    return head if head in fields else None
