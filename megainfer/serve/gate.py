"""The door every HTTP request passes before the app reads a byte of its body (a pure ASGI
middleware): the API key (401 with ``WWW-Authenticate`` before the body is read), the body's
size (413: at once from ``Content-Length``, else as soon as the bytes read pass
``serve.max_body_bytes``), the client's pace (408 when it pauses longer than
``serve.body_timeout_s`` inside its body), and the last resort for a bug: an unexpected
exception is logged once with its request id and answered with an OpenAI-shaped 500, and the
connection stays usable. docs/serve.md, "Limits"."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from typing import Callable, Optional

from .errors import BEARER, error_body

log = logging.getLogger("megainfer.serve")


def bearer_ok(headers: list, api_key: str) -> bool:
    """The raw ASGI headers carry ``Authorization: Bearer <api_key>`` (constant-time)."""
    got = next((v for k, v in headers if k == b"authorization"), b"")
    return secrets.compare_digest(got, f"Bearer {api_key}".encode())


async def send_error(send, status: int, message: str, code: Optional[str] = None,
                     headers: Optional[dict] = None) -> None:
    """One whole OpenAI-shaped JSON error response on a raw ASGI ``send``."""
    body = json.dumps(error_body(message, status, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _Exchange:
    """One request's ``receive`` and ``send`` as the gate hands them to the app: the body's
    bytes counted and timed; once the gate has answered, what the app sends is dropped and
    it reads a disconnect."""

    def __init__(self, receive, send, max_bytes: int, timeout_s: float):
        self._receive, self._send = receive, send
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.read = 0
        self.started = self.answered = self.body_done = False

    async def receive(self):
        if self.answered:
            return {"type": "http.disconnect"}
        if self.body_done:  # the app waits for a disconnect now: no bound on that
            return await self._receive()
        try:
            msg = await asyncio.wait_for(self._receive(), self.timeout_s)
        except asyncio.TimeoutError:
            await self.answer(408, f"request body: nothing received for {self.timeout_s:g}s "
                                   "(serve.body_timeout_s)", "request_timeout")
            return {"type": "http.disconnect"}
        if msg["type"] == "http.request":
            self.body_done = not msg.get("more_body", False)
            self.read += len(msg.get("body", b""))
            if self.read > self.max_bytes:
                await self.answer(413, f"request body: more than serve.max_body_bytes="
                                       f"{self.max_bytes} bytes", "request_too_large")
                return {"type": "http.disconnect"}
        return msg

    async def send(self, msg):
        if self.answered:
            return
        if msg["type"] == "http.response.start":
            self.started = True
        await self._send(msg)

    async def answer(self, status: int, message: str, code: str) -> None:
        """The gate's own response, unless the app's has begun (then it only stops reading)."""
        if not self.started:
            self.started = True
            await send_error(self._send, status, message, code)
        self.answered = True


class RequestGate:
    """``protected(path, method)``: whether the path needs the key (``api_key`` None: none
    does)."""

    def __init__(self, app, api_key: Optional[str], protected: Callable[[str], bool],
                 max_body_bytes: int, body_timeout_s: float):
        self.app, self.api_key, self.protected = app, api_key, protected
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and self.protected(scope["path"]) \
                and not bearer_ok(scope["headers"], self.api_key):
            return await send_error(send, 401, "missing or wrong API key (Authorization: "
                                    "Bearer <key>)", "invalid_api_key", BEARER)
        length = _content_length(scope["headers"])
        if length is not None and length > self.max_body_bytes:
            return await send_error(send, 413, f"request body of {length} bytes: more than "
                                    f"serve.max_body_bytes={self.max_body_bytes}",
                                    "request_too_large")
        ex = _Exchange(receive, send, self.max_body_bytes, self.body_timeout_s)
        try:
            await self.app(scope, ex.receive, ex.send)
        except Exception:  # noqa: BLE001 - a bug: answered, logged once, the server goes on
            rid = f"err-{uuid.uuid4().hex[:12]}"
            log.exception("[serve] internal error %s on %s %s", rid, scope.get("method"),
                          scope["path"])
            await ex.answer(500, f"internal server error (logged as {rid})", "internal_error")


def _content_length(headers: list) -> Optional[int]:
    raw = next((v for k, v in headers if k == b"content-length"), None)
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None
