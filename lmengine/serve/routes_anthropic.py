"""The Anthropic router: POST /v1/messages and POST /v1/messages/count_tokens, behind the
API keys (`x-api-key` or a bearer token), errors in Anthropic's shape."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from lmengine.serve.anthropic import count_tokens, create_message
from lmengine.serve.anthropic_protocol import CountTokensRequest, MessagesRequest, TokenCount
from lmengine.serve.auth import api_key_check
from lmengine.serve.client import ServerContext
from lmengine.serve.errors import AnthropicErrorBody, error_responses

# a message: JSON, or Anthropic's server-sent events when streamed; and its errors
MESSAGE_RESPONSES = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}},
    **error_responses(400, 401, 404, 413, 429, 499, 500, 503, 504, body=AnthropicErrorBody),
}


def anthropic_router(client: ServerContext) -> APIRouter:
    """Anthropic's Messages API over `client`, behind the API keys."""
    router = APIRouter(
        dependencies=[Depends(api_key_check(client.settings.api_keys))], tags=["anthropic"]
    )

    @router.post("/v1/messages", responses=MESSAGE_RESPONSES)
    async def v1_messages(body: MessagesRequest, request: Request):
        return await create_message(client, body, request, "messages")

    @router.post(
        "/v1/messages/count_tokens",
        response_model=TokenCount,
        responses=error_responses(400, 401, 404, 413, 500, body=AnthropicErrorBody),
    )
    async def v1_messages_count_tokens(body: CountTokensRequest):
        return await count_tokens(client, body)

    return router
