"""The health and metrics router: /health, /ping, /engine_check (no key needed) and the
Prometheus /metrics (behind the API keys)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from lmengine.serve.auth import api_key_check
from lmengine.serve.client import ServerContext
from lmengine.serve.errors import APIError, error_responses

ENGINE_TIMEOUT_S = 15.0  # a busy step may hold the loop; longer than that is a dead engine


def health_router(client: ServerContext) -> APIRouter:
    """Liveness of the process and of the engine loop, and the metrics of both."""
    router = APIRouter(tags=["health"])
    engine = client.engine

    @router.get("/health", responses=error_responses(503))
    async def health():
        if not engine.is_alive:
            raise APIError(503, "the engine is not running", "service_unavailable")
        return {"status": "ok"}

    @router.get("/ping", response_class=PlainTextResponse)
    async def ping():
        return PlainTextResponse("pong")

    @router.get("/engine_check", responses=error_responses(503))
    async def engine_check():
        """The engine loop answers between steps (a round trip through its thread)."""
        try:
            await asyncio.wait_for(
                asyncio.to_thread(engine.call, lambda: True, 10.0), ENGINE_TIMEOUT_S
            )
        except Exception as e:
            raise APIError(503, f"engine check failed: {e}", "service_unavailable") from None
        return {"status": "ok", "engine": "alive"}

    @router.get(
        "/metrics",
        dependencies=[Depends(api_key_check(client.settings.api_keys))],
        response_class=PlainTextResponse,
        responses=error_responses(401),
    )
    async def metrics():
        stats: dict = {}
        if engine.is_alive:
            try:
                stats = await asyncio.wait_for(asyncio.to_thread(engine.stats), ENGINE_TIMEOUT_S)
            except Exception:
                stats = {}
        return PlainTextResponse(
            client.metrics.render(stats), media_type="text/plain; version=0.0.4"
        )

    return router
