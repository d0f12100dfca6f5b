"""Error answers of the HTTP API: OpenAI's body, or Anthropic's on Anthropic's paths.

`APIError` is what handlers raise; `engine_error` maps an engine refusal to its status; and
`install_error_handlers` makes every failure (validation, unknown path, unexpected exception)
a JSON body counted in the server metrics. The body's shape follows the request's path
(`error_body`): Anthropic's `{"type": "error", "error": {type, message}}` under
/v1/messages, OpenAI's `{"error": {message, type, param, code}}` everywhere else; the
status is the same either way.
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmengine.engine.request import STEP_FAILED
from lmengine.serve.metrics import ServerMetrics

logger = logging.getLogger("lmengine.serve")

# how the engine's messages begin when it has stopped (closed, its loop died, a
# tensor-parallel worker died or a broadcast step failed): the request is answered 503
ENGINE_GONE = ("engine closed", "engine loop died", "tensor-parallel")


class ErrorBody(BaseModel):
    """OpenAI's error body, as every error answer carries it."""

    class Detail(BaseModel):
        message: str
        type: str
        param: str | None = None
        code: str | int | None = None

    error: Detail


class AnthropicErrorBody(BaseModel):
    """Anthropic's error body, as every error answer under /v1/messages carries it."""

    class Detail(BaseModel):
        type: str
        message: str

    type: Literal["error"]
    error: Detail


def error_responses(*statuses: int, body: type[BaseModel] = ErrorBody) -> dict:
    """OpenAPI `responses` for error statuses, each with the error `body` (default: OpenAI's)."""
    return {s: {"model": body, "description": ERROR_MEANINGS[s]} for s in statuses}


ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error type of each status (another 4xx: invalid_request_error, 5xx: api_error)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def speaks_anthropic(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape (/v1/messages and below it)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


ERROR_MEANINGS = {
    400: "invalid request (the message says what is wrong)",
    401: "missing or wrong API key",
    403: "not allowed by the server's configuration (the message names the rule)",
    404: "unknown model or adapter",
    408: "headers or body too slow (--header-timeout, --body-timeout)",
    413: "request body too large",
    429: "too many queued requests (see Retry-After)",
    499: "request cancelled",
    500: "the step running the request failed",
    503: "the engine is not running, the server is shutting down, or too many connections",
    504: "the request timed out (--request-timeout)",
}
# a generation's answer: JSON, or server-sent events when streamed; and its errors
GENERATION_RESPONSES = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}},
    **error_responses(400, 401, 404, 413, 429, 499, 500, 503, 504),
}


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

    def anthropic_body(self) -> dict:
        """Anthropic's body: {"type": "error", "error": {"type", "message"}}."""
        kind = ANTHROPIC_TYPES.get(self.status)
        if kind is None:
            kind = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def error_body(err: APIError, path: str) -> dict:
    """The body of `err` answering a request for `path` (Anthropic's or OpenAI's shape)."""
    return err.anthropic_body() if speaks_anthropic(path) else err.body()


def engine_error(message: str) -> APIError:
    """The HTTP error for a request the engine refused before generating anything."""
    if message.startswith(ENGINE_GONE):
        return APIError(503, message, "service_unavailable", "engine_unavailable")
    if message.startswith(STEP_FAILED):
        return APIError(500, message, "server_error")
    return APIError(400, message)


# failures while generating that the request itself caused (its constraint, its processors)
REQUEST_FAULTS = ("structured output:", "logits processor")


def generation_error(message: str) -> APIError:
    """The HTTP error for a request that failed while generating: 400 when the request
    caused it, else the engine's status (500 when the step failed)."""
    if message.startswith(REQUEST_FAULTS):
        return APIError(400, message)
    err = engine_error(message)
    return APIError(500, message, "server_error") if err.status == 400 else err


def _is_tag(part) -> bool:
    """Whether a part of an error's location is a tagged union's tag: the request models
    name every tag with a space ("user message", "text input"), which no field name has."""
    return isinstance(part, str) and " " in part


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Answer every error of `app` with the body its path speaks (`error_body`) and count
    it by status."""

    def error_json(request: Request, err: APIError) -> JSONResponse:
        metrics.count_error(err.status)
        body = error_body(err, request.url.path)
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_json(request, err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        problems = []
        param = None
        for e in err.errors()[:3]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _is_tag(x)]
            param = param or (".".join(loc) or None)
            message = str(e.get("msg", "")).removeprefix("Value error, ")
            problems.append(f"{'.'.join(loc) or 'body'}: {message}")
        answer = APIError(400, "invalid request: " + "; ".join(problems), param=param)
        return error_json(request, answer)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        code = "not_found" if err.status_code == 404 else None
        headers = getattr(err, "headers", None)  # 405: Allow
        answer = APIError(err.status_code, str(err.detail), code=code, headers=headers)
        return error_json(request, answer)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        answer = APIError(500, f"internal error: {type(err).__name__}", "server_error")
        return error_json(request, answer)
