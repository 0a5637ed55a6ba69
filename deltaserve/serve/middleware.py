"""Pure ASGI middleware around the app (pure ASGI, not BaseHTTPMiddleware, so streaming responses pass
through untouched):

- `CatchServerErrors`: a bug in a handler becomes one logged traceback and a 500 in OpenAI's shape. The
  exception stops here: Starlette's ServerErrorMiddleware would log it again and re-raise it to uvicorn,
  which then closes the keep-alive connection under the client's next request.
- `RequireAPIKey`: with --api-key, every route but /health (and /metrics, if the operator opts out) wants
  the key: as `Authorization: Bearer KEY` (API clients) or HTTP Basic with KEY as the password (a browser
  on /inspect or /docs asks for it once and resends it with every fetch and event stream of the page).
- `LimitRequestBody`: a body over the cap is refused with a 413 before it is parsed; the body is read here
  (bounded) and replayed to the app."""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.serve.errors import error_response

log = logging.getLogger("deltaserve.serve")


class CatchServerErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            log.exception("internal error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                response = error_response(500, f"internal error: {type(e).__name__}: {e}")
                await response(scope, receive, send)


class RequireAPIKey:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: Iterable[str]) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"authorization")
        if self._accepts(header):
            await self.app(scope, receive, send)
            return
        message = "Incorrect API key provided." if header else "Missing API key: send 'Authorization: Bearer KEY'."
        response = error_response(401, message, code="invalid_api_key")
        browser_page = scope["path"].startswith(("/inspect", "/docs", "/redoc"))
        # Basic makes a browser ask for the key (any user name, the key as password) and send it after.
        response.headers["WWW-Authenticate"] = 'Basic realm="deltaserve"' if browser_page else "Bearer"
        await response(scope, receive, send)

    def _accepts(self, header: str) -> bool:
        scheme, _, value = header.partition(" ")
        value = value.strip()
        if scheme.lower() == "basic":
            try:
                value = base64.b64decode(value, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.encode(errors="replace"), self.key)


class _BodyTooLarge(Exception):
    pass


class LimitRequestBody:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        try:
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise _BodyTooLarge()
            body = await self._read(receive)
        except _BodyTooLarge:
            response = error_response(
                413,
                f"The request body is larger than this server accepts ({self.max_bytes} bytes; see "
                "--max-request-body-bytes).",
                code="request_too_large",
            )
            response.headers["Connection"] = "close"  # the rest of the body is not read
            await response(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect, for is_disconnected()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""
