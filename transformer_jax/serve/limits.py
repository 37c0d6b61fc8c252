"""Request bodies read before the app sees them: at most ``max_bytes``, within ``timeout`` s.

``BodyLimits``, an ASGI middleware, refuses a body above the limit (413), not whole in time
(408) or still arriving when the server drains (503), closing the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from transformer_jax.serve.protocol import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Default ``--max-body-bytes``: 8 MiB (a 128k-token prompt as ids is about 1 MB of JSON).
DEFAULT_MAX_BODY_BYTES = 8 * 2 ** 20
#: Default ``--body-timeout``, in seconds.
DEFAULT_BODY_TIMEOUT_S = 30.0
#: How often a body that is slow to arrive checks whether the server is draining, in seconds.
POLL_S = 0.25


class _Gone(Exception):
    """The client went away before its body was whole."""


class BodyLimits:
    """ASGI middleware reading each HTTP request's body first, within the limits.

    Args:
      app: the ASGI app behind it.
      max_bytes: the largest body accepted, in bytes (> 0).
      timeout: seconds from the request's headers to its whole body (> 0); None for no limit.
      draining: True once the server is shutting down (a body still arriving then gets 503).
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 timeout: float | None = DEFAULT_BODY_TIMEOUT_S,
                 draining: Callable[[], bool] = lambda: False) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive or None, got {timeout}")
        self.app, self.max_bytes, self.timeout, self.draining = app, max_bytes, timeout, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout or DEFAULT_BODY_TIMEOUT_S)
        try:
            self._check_length(scope)
            body = await self._read(receive, None if self.timeout is None else deadline)
        except APIError as e:  # a refusal
            await _refuse(send, e)
            if e.status == 413:
                await self._drop_rest(receive, deadline)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        except _Gone:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"the request body is {size}: more than this server's limit of "
                        f"{self.max_bytes} bytes (--max-body-bytes)", None, "request_too_large")

    def _check_length(self, scope: Scope) -> None:
        for name, value in scope.get("headers", ()):
            if name.lower() != b"content-length":
                continue
            try:
                length = int(value)
            except ValueError:
                raise APIError(400, f"Content-Length must be a byte count, got "
                               f"{value[:40]!r}", None, "invalid_request") from None
            if length > self.max_bytes:
                raise self._too_large(f"{length} bytes (Content-Length)")

    async def _read(self, receive: Receive, deadline: float | None) -> bytes:
        chunks, size = [], 0
        while True:
            message = await self._next(receive, deadline)
            if message["type"] == "http.disconnect":
                raise _Gone
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise self._too_large(f"over {self.max_bytes} bytes (counted as it came)")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _drop_rest(self, receive: Receive, deadline: float) -> None:
        """Reads and drops what is left of a refused body, until its end or ``deadline``."""
        with contextlib.suppress(APIError):
            while True:
                message = await self._next(receive, deadline)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return

    async def _next(self, receive: Receive, deadline: float | None) -> Message:
        """The next message, or ``APIError`` once ``deadline`` passes or the server drains."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(receive())
        try:
            while True:
                wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - loop.time()))
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
                if self.draining():
                    raise APIError(503, "the server is shutting down", None,
                                   "server_shutting_down")
                if deadline is not None and loop.time() >= deadline:
                    raise APIError(408, f"the request body did not arrive within "
                                   f"{self.timeout:g} s (--body-timeout)", None,
                                   "request_timeout")
        finally:
            if not task.done():
                task.cancel()


async def _refuse(send: Send, error: APIError) -> None:
    """Sends ``error`` as OpenAI's error object, all of it, and asks the server to close the
    connection once the response ends (the caller ends it, with an empty last body)."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": True})
