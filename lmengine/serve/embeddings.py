"""POST /v1/embeddings: OpenAI's embeddings from the served decoder model, as vLLM serves them.

Each input (a text, token ids, or a list of either) runs as a prompt-only engine request in
the ordinary batches; its embedding is the final norm's output pooled over the input (the
last token by default, vLLM's pooling for a causal LM; `--embedding-pooling mean` for the
mean), L2-normalized. `encoding_format` "base64" sends the float32 little-endian bytes, as
OpenAI's SDK decodes them. `dimensions` is refused unless it is the model's width (a decoder
model's vectors are not trained to be cut short): the body's model is built for the served
model (`embedding_request`), so the OpenAPI document says so too.
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Literal

import torch
from fastapi import Request
from pydantic import ConfigDict, Field, create_model

from lmengine.config import GenerationConfig
from lmengine.serve.client import ServerContext
from lmengine.serve.errors import APIError
from lmengine.serve.protocol import TokenId, _Body
from lmengine.serve.streaming import run_job

MAX_INPUTS = 2048  # per request, as OpenAI's API

Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | Ids
        | Annotated[list[Ids], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # only the model's width: embedding_request
    user: str | None = Field(None, max_length=256)  # the QoS user


def embedding_request(width: int) -> type[EmbeddingRequest]:
    """The body of /v1/embeddings for a model `width` wide: `dimensions` that width or absent."""
    only_width = Literal[width]  # type: ignore[valid-type]
    return create_model(
        "EmbeddingRequest",
        __base__=EmbeddingRequest,
        dimensions=(
            only_width | None,
            Field(None, description=f"this model's embeddings have {width} dimensions"),
        ),
    )


async def create_embedding(
    client: ServerContext, body: EmbeddingRequest, request: Request, endpoint: str
) -> dict:
    """Validate, submit one prompt-only engine request per input, answer OpenAI's list."""
    adapter = client.adapter_for(body.model)
    given = body.input
    inputs: list[str | list[int]]
    if isinstance(given, str) or all(isinstance(t, int) for t in given):
        inputs = [given]  # type: ignore[list-item]
    else:
        inputs = list(given)  # type: ignore[arg-type]
    ids = await client.off_loop(
        lambda: [client.encode_text(x) if isinstance(x, str) else list(x) for x in inputs]
    )
    if not all(ids):
        raise APIError(400, "an input gives no tokens", param="input")
    config = GenerationConfig(max_new_tokens=0, pooling=client.settings.embedding_pooling)
    job = client.new_job(endpoint, request)
    client.submit(job, ids, [config] * len(ids), adapter, None, body.user)

    def whole() -> dict:
        data = []
        for i, choice in enumerate(job.choices):
            assert choice.final is not None  # NOTE: run_job returns once every choice ended
            vector = torch.nn.functional.normalize(choice.final.embedding, dim=-1)
            data.append({"object": "embedding", "index": i, "embedding": _encode(vector, body)})
        prompt_tokens = client.usage(job, 1)["prompt_tokens"]
        return {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "data": data,
            "model": client.model_name(body),
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }

    async def no_stream():  # pragma: no cover - embeddings are never streamed
        yield ""

    return await run_job(job, request, False, whole, no_stream)  # type: ignore[return-value]


def _encode(vector: torch.Tensor, body: EmbeddingRequest) -> list[float] | str:
    if body.encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
