"""ASGI guards in front of the app: the API key, JSON-only bodies, the body-size limit and the
body read timeout. Plain ASGI wrappers, not Starlette's BaseHTTPMiddleware, which hides client
disconnects from the endpoints (they must abort abandoned requests)."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi.responses import JSONResponse

from kdaserve.server.protocol import error_body

OPEN_PATHS = ("/health", "/metrics")  # no API key: load balancers and Prometheus probe them


async def _refuse(scope: dict[str, Any], receive: Any, send: Any, status: int,
                  message: str) -> None:
    await JSONResponse(error_body(message, status), status_code=status)(scope, receive, send)


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but OPEN_PATHS; the scheme is matched
    case-insensitively (RFC 9110) and the key in constant time."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                await _refuse(scope, receive, send, 401, "invalid API key")
                return
        await self.app(scope, receive, send)


class BodyGuard:
    """POST bodies: JSON only (a `text/plain` POST is a CORS "simple request" any web page can
    send; JSON is not; a bodiless POST only from a script or this server's own pages), at
    most `max_bytes`, all of it within `read_timeout` seconds (the timeout ends with the
    body: a streaming response then waits on receive for a disconnect)."""

    def __init__(self, app: Any, max_bytes: int, read_timeout: float) -> None:
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        bodiless = headers.get(b"content-length", b"0") == b"0" \
            and b"transfer-encoding" not in headers
        # a bodiless POST (SGLang's clients call /flush_cache so) passes unless a browser on
        # another site sent it: browsers name the Origin of every POST, scripts do not
        origin = headers.get(b"origin")
        same_site = origin is not None and origin.split(b"://", 1)[-1] == headers.get(b"host")
        if bodiless and (origin is None or same_site):
            await self.app(scope, receive, send)
            return
        if kind != b"application/json" and not kind.endswith(b"+json"):
            await _refuse(scope, receive, send, 415, "request bodies must be JSON "
                          f"(Content-Type: application/json), got {kind.decode() or 'none'!r}")
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _refuse(scope, receive, send, 413, f"request body of {int(length)} bytes "
                          f"exceeds the limit of {self.max_bytes} (--max-request-body-bytes)")
            return
        seen = 0
        body_done = False
        failed: list[tuple[int, str]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout  # for the whole body, not per chunk

        async def guarded_receive() -> dict[str, Any]:
            nonlocal seen, body_done
            if body_done:  # later receives wait for a disconnect, as long as a stream runs
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                failed.append((408, f"request body not received within {self.read_timeout:g} "
                                    "s (--body-read-timeout)"))
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # chunked bodies carry no Content-Length
                    failed.append((413, f"request body exceeds the limit of {self.max_bytes} "
                                        "bytes (--max-request-body-bytes)"))
                    return {"type": "http.disconnect"}
                body_done = not message.get("more_body", False)
            return message

        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if failed and not started:  # the app saw a disconnect; answer the client instead
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, guarded_receive, tracking_send)
        if failed and not started:
            status, message = failed[0]
            await _refuse(scope, receive, send, status, message)
