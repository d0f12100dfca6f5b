"""POST /v1/completions (and LMDeploy's /v1/completions_qos): raw prompts, no chat template.

Prompts (text or token ids, one or many) x `n` choices become one Job; the answer is OpenAI's
`text_completion`, whole or streamed, with `echo` and legacy `logprobs`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmengine.serve.client import EngineClient
from lmengine.serve.convert import gen_configs
from lmengine.serve.errors import APIError
from lmengine.serve.jobs import Job
from lmengine.serve.logprobs import completion_logprobs
from lmengine.serve.protocol import MAX_CHOICES, CompletionRequest
from lmengine.serve.streaming import ChunkShape, finish_reason, run_job, stream_choices, wants_usage

OBJECT = "text_completion"


async def create_completion(
    client: EngineClient, body: CompletionRequest, request: Request, endpoint: str
) -> dict | StreamingResponse:
    """Validate, submit one engine request per prompt and choice, and answer."""
    adapter = client.adapter_for(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (or be left out)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported", param="echo")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt) or [[]]
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} prompts x n per request", param="n")
    ids = [client.encode_text(p) if isinstance(p, str) else list(p) for p in prompts]
    configs = gen_configs(body, len(ids), body.max_tokens, body.logprobs, client.session_len)
    job = client.new_job(endpoint)
    client.check_queue(len(configs))
    job.submit(
        [p for p in ids for _ in range(body.n)],
        configs,
        adapter,
        body.priority,
        body.user_id or body.user,
    )
    echo = [p if isinstance(p, str) else None for p in prompts]
    return await run_job(
        job,
        request,
        body.stream,
        lambda: _whole(client, job, body, echo),
        lambda: _stream(client, job, body, echo),
    )


def _echo_texts(client: EngineClient, job: Job, body: CompletionRequest, echo) -> list[str]:
    """The prompts as text (token-id prompts decoded once the engine accepted them)."""
    ids = [c.input_ids for c in job.choices[:: body.n]]
    return [e if e is not None else client.tokenizer.decode(i) for e, i in zip(echo, ids)]


def _whole(client: EngineClient, job: Job, body: CompletionRequest, echo) -> dict:
    if body.echo:
        echo = _echo_texts(client, job, body, echo)
    choices = []
    for i, c in enumerate(job.choices):
        resp = c.final
        text = resp.text or ""
        if body.echo:
            text = echo[i // body.n] + text
        logprobs = None
        if body.logprobs is not None:
            logprobs, _ = completion_logprobs(resp, 0, body.logprobs, 0, client.token_text)
        choices.append(
            {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(resp)}
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": OBJECT,
        "created": int(time.time()),
        "model": client.model_name(body),
        "choices": choices,
        "usage": client.usage(job, body.n),
    }


def _stream(client: EngineClient, job: Job, body: CompletionRequest, echo) -> AsyncIterator[str]:
    shape = ChunkShape(f"cmpl-{uuid.uuid4().hex}", OBJECT, client.model_name(body))
    opening = []
    if body.echo:
        echo = _echo_texts(client, job, body, echo)
        opening = [
            shape.chunk(i, text=echo[i // body.n], logprobs=None, finish_reason=None)
            for i in range(len(job.choices))
        ]
    offsets = [0] * len(job.choices)  # characters of each choice's text sent so far

    def make_chunk(i: int, resp, delta: str, start: int) -> dict | None:
        logprobs = None
        if body.logprobs is not None:
            logprobs, offsets[i] = completion_logprobs(
                resp, start, body.logprobs, offsets[i], client.token_text
            )
        if not (delta or resp.finish_reason or logprobs):
            return None
        return shape.chunk(i, text=delta, logprobs=logprobs, finish_reason=finish_reason(resp))

    usage = (lambda: client.usage(job, body.n)) if wants_usage(body) else None
    return stream_choices(job, shape, opening, make_chunk, usage)
