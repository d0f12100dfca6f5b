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

from lmengine.serve.client import ServerContext
from lmengine.serve.convert import gen_configs
from lmengine.serve.errors import APIError
from lmengine.serve.jobs import Job
from lmengine.serve.logprobs import (
    completion_logprobs,
    echo_logprobs,
    join_legacy,
    vllm_prompt_logprobs,
)
from lmengine.serve.protocol import MAX_CHOICES, CompletionRequest
from lmengine.serve.streaming import ChunkShape, finish_reason, run_job, stream_choices, wants_usage

OBJECT = "text_completion"


async def create_completion(
    client: ServerContext, body: CompletionRequest, request: Request, endpoint: str
) -> dict | StreamingResponse:
    """Validate, submit one engine request per prompt and choice, and answer."""
    adapter = client.adapter_for(body.model)
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt) or [[]]
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} prompts x n per request", param="n")
    ids = await client.off_loop(
        lambda: [client.encode_text(p) if isinstance(p, str) else list(p) for p in prompts]
    )
    # the prompt's logprobs: echoed with `logprobs`, or vLLM's `prompt_logprobs` (the larger N)
    asked = [
        n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None
    ]
    configs = gen_configs(
        body, len(ids), body.max_tokens, body.logprobs, client.session_len, max(asked, default=None)
    )
    job = client.new_job(endpoint, request)
    client.submit(
        job,
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


def _echo_texts(client: ServerContext, job: Job, body: CompletionRequest, echo) -> list[str]:
    """The prompts as text (token-id prompts decoded once the engine accepted them)."""
    ids = [c.input_ids for c in job.choices[:: body.n]]
    return [e if e is not None else client.tokenizer.decode(i) for e, i in zip(echo, ids)]


def _whole(client: ServerContext, job: Job, body: CompletionRequest, echo) -> dict:
    if body.echo:
        echo = _echo_texts(client, job, body, echo)
    choices = []
    for i, c in enumerate(job.choices):
        resp = c.final
        text = resp.text or ""
        if body.echo:
            text = echo[i // body.n] + text
        echoed = echo[i // body.n] if body.echo else None
        choice = {"index": i, "text": text, "logprobs": _logprobs(client, body, c, resp, echoed)}
        choice["finish_reason"] = finish_reason(resp)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                c.input_ids, resp, body.prompt_logprobs, client.token_text
            )
        choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": OBJECT,
        "created": int(time.time()),
        "model": client.model_name(body),
        "choices": choices,
        "usage": client.usage(job, body.n),
    }


def _logprobs(
    client: ServerContext, body: CompletionRequest, choice, resp, echoed: str | None
) -> dict | None:
    """The legacy logprobs of a whole choice: over the `echoed` prompt text's tokens first."""
    if body.logprobs is None:
        return None
    if echoed is None:
        return completion_logprobs(resp, body.logprobs, 0, client.token_text)[0]
    prompt, _ = echo_logprobs(choice.input_ids, resp, body.logprobs, client.token_text)
    generated, _ = completion_logprobs(resp, body.logprobs, len(echoed), client.token_text)
    return join_legacy(prompt, generated)


def _stream(client: ServerContext, job: Job, body: CompletionRequest, echo) -> AsyncIterator[str]:
    """Streamed choices. The echoed prompt goes first; when its logprobs (or vLLM's
    `prompt_logprobs`) are asked, it waits for them and rides in each choice's first chunk."""
    shape = ChunkShape(f"cmpl-{uuid.uuid4().hex}", OBJECT, client.model_name(body))
    num = len(job.choices)
    echo = _echo_texts(client, job, body, echo) if body.echo else [""] * num
    offsets = [len(echo[i // body.n]) for i in range(num)]  # characters of text sent so far
    with_prompt = body.prompt_logprobs is not None or (body.echo and body.logprobs is not None)
    opening = []
    if body.echo and not with_prompt:
        opening = [
            shape.chunk(i, text=echo[i // body.n], logprobs=None, finish_reason=None)
            for i in range(num)
        ]
    first = [with_prompt] * num  # the choice's first chunk still has to carry its prompt

    def make_chunk(i: int, resp) -> dict | None:
        delta = resp.text or ""
        logprobs = None
        if body.logprobs is not None:
            logprobs, offsets[i] = completion_logprobs(
                resp, body.logprobs, offsets[i], client.token_text
            )
        extra = {}
        if first[i]:
            first[i] = False
            c = job.choices[i]
            if body.echo:
                delta = echo[i // body.n] + delta
                if logprobs is not None:
                    prompt, _ = echo_logprobs(c.input_ids, resp, body.logprobs, client.token_text)
                    logprobs = join_legacy(prompt, logprobs)
            if body.prompt_logprobs is not None:
                extra["prompt_logprobs"] = vllm_prompt_logprobs(
                    c.input_ids, resp, body.prompt_logprobs, client.token_text
                )
        # NOTE: a token without text yet (a special token, part of a character) is still a
        # chunk, as vLLM sends it: a client's first chunk must not wait for visible text
        new_tokens = bool(resp.token_ids)
        if not (delta or new_tokens or resp.finish_reason or logprobs or extra):
            return None
        return shape.chunk(
            i, text=delta, logprobs=logprobs, finish_reason=finish_reason(resp), **extra
        )

    usage = (lambda: client.usage(job, body.n)) if wants_usage(body) else None
    return stream_choices(job, shape, opening, make_chunk, usage)
