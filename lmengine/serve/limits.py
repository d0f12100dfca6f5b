"""The request body's limits: a body larger than `--max-body-mb` is answered 413 before it is
parsed (from its Content-Length, or as soon as a chunked body passes the limit); one that has
not arrived whole `--body-timeout` seconds after the headers is answered 408. And the answer
to a connection past `--max-connections` (`too_many_connections`, see connections.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.responses import JSONResponse

from lmengine.serve.errors import APIError, error_body
from lmengine.serve.metrics import ServerMetrics


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than the server's limit of {limit} bytes",
        code="request_too_large",
    )


def body_timed_out(timeout: float) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive within {timeout:g} s of its headers",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def too_many_connections(limit: int, metrics: ServerMetrics):
    """The ASGI app answering a connection past `--max-connections`: 503, Retry-After, and
    the connection closed."""
    err = APIError(
        503,
        f"the server has too many open connections (limit {limit}): retry later",
        "service_unavailable",
        "too_many_connections",
        headers={"Retry-After": "1", "Connection": "close"},
    )

    async def refuse(scope, receive, send) -> None:
        metrics.count_error(err.status)
        body = error_body(err, scope.get("path", ""))
        await JSONResponse(body, status_code=err.status, headers=err.headers)(scope, receive, send)

    return refuse


class BodyLimit:
    """ASGI middleware: 413 for an HTTP request body of more than `limit` bytes, 408 for one
    not read whole within `timeout` seconds (0: no limit, no timeout)."""

    def __init__(
        self,
        app,
        limit: int,
        metrics: ServerMetrics,
        timeout: float = 0.0,
        expect_arrival: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        """`expect_arrival` (the engine client's): announces each POST to the engine from
        here until the route submits it (`arrived`) or the response ends."""
        self.app, self.limit, self.metrics, self.timeout = app, limit, metrics, timeout
        self.expect_arrival = expect_arrival

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["received"] = time.monotonic()  # where a request's time starts (`received_at`)
        if self.expect_arrival is None or scope.get("method") != "POST":
            return await self._serve(scope, receive, send)
        done = state["arrived"] = self.expect_arrival()
        try:
            await self._serve(scope, receive, send)
        finally:
            done()

    async def _serve(self, scope, receive, send) -> None:
        if self.limit <= 0 and self.timeout <= 0:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit():
            if 0 < self.limit < int(declared):
                return await self._refuse(too_large(self.limit), scope, receive, send)
            if self.timeout <= 0:
                return await self.app(scope, receive, send)
        # NOTE: the body is read here (up to the limit, before the deadline), then handed on
        # as one message: every route reads it whole anyway, and none starts on half a body
        try:
            message = await asyncio.wait_for(self._read(receive), self.timeout or None)
        except asyncio.TimeoutError:
            return await self._refuse(body_timed_out(self.timeout), scope, receive, send)
        if message is None:
            return await self._refuse(too_large(self.limit), scope, receive, send)
        await self.app(scope, _replay([message], receive), send)

    async def _read(self, receive) -> dict | None:
        """The whole body as one message (or the disconnect that cut it); None past the
        limit."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return message
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if 0 < self.limit < size:
                return None
            more = message.get("more_body", False)
        return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, err: APIError, scope, receive, send) -> None:
        self.metrics.count_error(err.status)
        body = error_body(err, scope.get("path", ""))  # in the shape of the path's API
        await JSONResponse(body, status_code=err.status, headers=err.headers)(scope, receive, send)


def received_at(request) -> float | None:
    """When the server first saw `request` (time.monotonic()), before reading its body."""
    return getattr(request.state, "received", None)


def arrived_callback(request) -> Callable[[], None] | None:
    """What tells the engine that `request`, announced on arrival, is submitted (None where it
    was not announced)."""
    return getattr(request.state, "arrived", None)


def _replay(messages: list[dict], then=None):
    """An ASGI `receive` that returns `messages`, then defers to `then`."""

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive
