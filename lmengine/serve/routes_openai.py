"""The OpenAI router: GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /v1/embeddings, POST /v1/responses (and GET of a stored one)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from lmengine.serve.auth import api_key_check
from lmengine.serve.chat import create_chat_completion
from lmengine.serve.client import ServerContext
from lmengine.serve.completions import create_completion
from lmengine.serve.embeddings import create_embedding, embedding_request
from lmengine.serve.errors import GENERATION_RESPONSES, error_responses
from lmengine.serve.protocol import ChatCompletionRequest, CompletionRequest
from lmengine.serve.responses import ResponseStore, create_response
from lmengine.serve.responses_protocol import ResponsesRequest


def openai_router(client: ServerContext) -> APIRouter:
    """OpenAI's model list and (chat) completions over `client`, behind the API keys."""
    router = APIRouter(dependencies=[Depends(api_key_check(client.settings.api_keys))])
    name = client.settings.model_name

    @router.get("/v1/models", responses=error_responses(401))
    async def models():
        base = {
            "id": name,
            "object": "model",
            "created": client.created,
            "owned_by": "lmengine",
            "root": name,
            "parent": None,
            "max_model_len": client.session_len,
        }
        # NOTE: read at request time: adapters added or removed while serving show up here
        adapters = [
            {**base, "id": adapter, "root": adapter, "parent": name}
            for adapter in client.adapter_names()
        ]
        return {"object": "list", "data": [base, *adapters]}

    @router.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def v1_completions(body: CompletionRequest, request: Request):
        return await create_completion(client, body, request, "completions")

    @router.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(client, body, request, "chat_completions")

    store = ResponseStore()
    client.metrics.track("stored_responses", lambda: len(store.entries))

    @router.post("/v1/responses", responses=GENERATION_RESPONSES)
    async def v1_responses(body: ResponsesRequest, request: Request):
        return await create_response(client, store, body, request)

    @router.get("/v1/responses/{response_id}", responses=error_responses(401, 404))
    async def v1_get_response(response_id: str):
        """A stored response (`store` true, the last 1,024 kept)."""
        return store.get(response_id)[0]

    async def v1_embeddings(body, request: Request):
        return await create_embedding(client, body, request, "embeddings")

    # NOTE: the body's model is built for the served model's width (`dimensions`)
    v1_embeddings.__annotations__["body"] = embedding_request(client.engine.info.hidden_size)
    router.post(
        "/v1/embeddings", responses=error_responses(400, 401, 404, 413, 429, 499, 500, 503, 504)
    )(v1_embeddings)

    return router
