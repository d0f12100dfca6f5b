"""Error answers of the HTTP API, always with OpenAI's body.

`APIError` is what handlers raise; `engine_error` maps an engine refusal to its status; and
`install_error_handlers` makes every failure (validation, unknown path, unexpected exception)
an OpenAI-style JSON body counted in the server metrics.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmengine.engine.request import STEP_FAILED
from lmengine.serve.metrics import ServerMetrics

logger = logging.getLogger("lmengine.serve")

ENGINE_GONE = ("engine closed", "engine loop died")


class APIError(Exception):
    """An error answer with OpenAI's body: {"error": {message, type, param, code}}.

    Owns the status, the body and extra headers; it never logs or counts itself (the
    handlers installed by `install_error_handlers` do).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.param, self.headers = param, headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


def engine_error(message: str) -> APIError:
    """The HTTP error for a request the engine refused before generating anything."""
    if message.startswith(ENGINE_GONE):
        return APIError(503, message, "service_unavailable", "engine_unavailable")
    if message.startswith(STEP_FAILED):
        return APIError(500, message, "server_error")
    return APIError(400, message)


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Answer every error of `app` with OpenAI's body and count it by status."""

    def error_json(err: APIError) -> JSONResponse:
        metrics.count_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_json(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        problems = []
        param = None
        for e in err.errors()[:3]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            problems.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        return error_json(APIError(400, "invalid request: " + "; ".join(problems), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        code = "not_found" if err.status_code == 404 else None
        return error_json(APIError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_json(APIError(500, f"internal error: {type(err).__name__}", "server_error"))
