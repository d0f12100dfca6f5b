"""The OpenAI-compatible HTTP API over one Engine (FastAPI).

`build_app(engine, settings)` returns the ASGI app: one `ServerContext` shared by the routers
(OpenAI, Anthropic's Messages, QoS, health/metrics, tokenizer) and error handlers that answer
in OpenAI's shape (Anthropic's on its paths). Handlers turn a
request body into token ids and GenerationConfigs, run them as a `Job` (one engine request
per choice) and answer as OpenAI does, whole or streamed. The engine runs in its own thread;
nothing here touches the scheduler or the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI

from lmengine.serve.client import ServerContext
from lmengine.serve.convert import gen_configs as _gen_configs  # noqa: F401 - the old name
from lmengine.serve.errors import install_error_handlers
from lmengine.serve.jobs import ResponseRouter
from lmengine.serve.limits import BodyLimit
from lmengine.serve.routes_anthropic import anthropic_router
from lmengine.serve.routes_health import health_router
from lmengine.serve.routes_lora import lora_router
from lmengine.serve.routes_openai import openai_router
from lmengine.serve.routes_qos import qos_router
from lmengine.serve.routes_tokenizer import tokenizer_router
from lmengine.serve.settings import ServerSettings

__all__ = ["ServerContext", "ServerSettings", "build_app"]


def build_app(engine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` (already started; closed at app shutdown)."""
    client = ServerContext(engine, settings)

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.router = ResponseRouter(asyncio.get_running_loop())
        yield
        client.end_requests("server shutdown")
        client.close()
        await asyncio.to_thread(engine.close)

    app = FastAPI(
        title="lmengine",
        description="OpenAI-compatible API of lmengine, Anthropic's Messages API and "
        "LMDeploy's QoS endpoints",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.client = client
    app.openapi = lambda: _openapi(app, engine.info.vocab_size)
    install_error_handlers(app, client.metrics)
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        metrics=client.metrics,
        timeout=settings.body_timeout,
        expect_arrival=engine.client.expect_arrival,
    )
    # NOTE: this order is the order of the paths in the OpenAPI document
    app.include_router(health_router(client))
    app.include_router(openai_router(client))
    app.include_router(anthropic_router(client))
    app.include_router(qos_router(client))
    app.include_router(tokenizer_router(client))
    if settings.enable_lora_updates:
        app.include_router(lora_router(client))
    return app


def _openapi(app: FastAPI, vocab_size: int) -> dict:
    """FastAPI's OpenAPI document, stating what this server does: no 422 (a body that does
    not validate is a 400, listed per route), errors as JSON on every route, and token ids
    bounded by the served vocabulary."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)  # fmt: skip
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                responses.pop("422", None)
                for status, response in responses.items():
                    content = response.get("content", {})
                    # NOTE: FastAPI files every response under the route's media type; an
                    # error is OpenAI's JSON body on text routes too
                    if int(status) >= 400 and "application/json" not in content:
                        plain = content.pop("text/plain", {})
                        content["application/json"] = plain
        _bound_token_ids(schema, vocab_size - 1)
        app.openapi_schema = schema
    return app.openapi_schema


def _bound_token_ids(node, highest: int) -> None:
    """Every token id of the document (marked x-token-id) bounded by `highest`."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False):
            node["maximum"] = highest
        for child in node.values():
            _bound_token_ids(child, highest)
    elif isinstance(node, list):
        for child in node:
            _bound_token_ids(child, highest)
