"""The request body limit: a body larger than `--max-body-mb` is answered 413 before it is
parsed (from its Content-Length, or as soon as a chunked body passes the limit)."""

from __future__ import annotations

import time

from starlette.responses import JSONResponse

from lmengine.serve.errors import APIError, error_body
from lmengine.serve.metrics import ServerMetrics


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than the server's limit of {limit} bytes",
        code="request_too_large",
    )


class BodyLimit:
    """ASGI middleware: 413 for an HTTP request body of more than `limit` bytes."""

    def __init__(self, app, limit: int, metrics: ServerMetrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":  # where a request's time starts (`received_at`)
            scope.setdefault("state", {})["received"] = time.monotonic()
        if scope["type"] != "http" or self.limit <= 0:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        # NOTE: no length given (chunked): the body is read here, up to the limit, then
        # handed on as one message (the route would read it whole anyway)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            more = message.get("more_body", False)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope, receive, send) -> None:
        err = too_large(self.limit)
        self.metrics.count_error(err.status)
        body = error_body(err, scope.get("path", ""))  # in the shape of the path's API
        await JSONResponse(body, status_code=err.status)(scope, receive, send)


def received_at(request) -> float | None:
    """When the server first saw `request` (time.monotonic()), before reading its body."""
    return getattr(request.state, "received", None)


def _replay(messages: list[dict], then=None):
    """An ASGI `receive` that returns `messages`, then defers to `then`."""

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive
