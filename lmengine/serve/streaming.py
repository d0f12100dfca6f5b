"""Answering a Job, whole or streamed, written once for every endpoint.

`run_job` waits for the job's first response (so a refusal is a 4xx status, not a broken
stream), then answers with the whole body or a `StreamingResponse`; a client that leaves
cancels the job and frees its KV blocks. `stream_choices` is the event stream of chat and
completions: per-choice deltas as the engine sends them, an error event for a choice that
fails mid-way, the `include_usage` chunk and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmengine.engine.request import Response
from lmengine.serve.errors import APIError, generation_error
from lmengine.serve.jobs import Job

FINISH_REASONS = {"stop": "stop", "length": "length", "cancel": "abort", "error": "error"}


def finish_reason(resp: Response) -> str | None:
    """OpenAI's finish reason of a response (None while it runs)."""
    return FINISH_REASONS.get(resp.finish_reason) if resp.finish_reason else None


@dataclass(frozen=True)
class Framing:
    """How a stream writes its events: server-sent events (ended by `data: [DONE]`) or
    newline-delimited JSON (no end marker). Formats text only; never sees a Job."""

    media_type: str
    prefix: str
    suffix: str
    done: str

    def event(self, data: Any) -> str:
        return f"{self.prefix}{json.dumps(data, ensure_ascii=False)}{self.suffix}"


SSE = Framing("text/event-stream", "data: ", "\n\n", "data: [DONE]\n\n")
NDJSON = Framing("application/x-ndjson", "", "\n", "")


async def run_job(
    job: Job,
    request: Request,
    is_stream: bool,
    whole: Callable[[], dict],
    stream: Callable[[], AsyncIterator[str]],
    framing: Framing = SSE,
) -> dict | StreamingResponse:
    """Wait for the job's first response, then answer `whole()` once every choice has
    finished, or stream `stream()`'s events; a client that leaves cancels the job."""
    watcher = asyncio.create_task(job.watch_disconnect(request))
    try:
        await job.wait_started()
        if not is_stream:
            async for _ in job.responses():
                pass
            failed = [c.final for c in job.choices if c.final.finish_reason == "error"]
            if failed:  # failed while generating (the engine died or closed)
                raise generation_error(failed[0].error or "generation failed")
            return whole()
    except BaseException:
        job.cancel("failed")
        raise
    finally:
        watcher.cancel()
    return StreamingResponse(_guarded(job, stream(), framing), media_type=framing.media_type)


async def _guarded(job: Job, events: AsyncIterator[str], framing: Framing) -> AsyncIterator[str]:
    """The stream's events; an APIError (a timeout) becomes a last error event. When the
    stream ends early (client gone: the task is cancelled, or the generator closed) the
    job is cancelled and its blocks freed."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except APIError as err:
        yield framing.event(err.body())
        if framing.done:
            yield framing.done
    finally:
        if not job.is_done:
            job.cancel("client disconnected")


@dataclass
class ChunkShape:
    """The envelope every chunk of one stream shares (id, object, created, model)."""

    id: str
    object: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, index: int, **fields: Any) -> dict:
        """One choice's chunk; `fields` in order (text or delta, logprobs, finish_reason)."""
        head = {"id": self.id, "object": self.object, "created": self.created}
        return {**head, "model": self.model, "choices": [{"index": index, **fields}]}

    def usage_chunk(self, usage: dict) -> dict:
        head = {"id": self.id, "object": self.object, "created": self.created}
        return {**head, "model": self.model, "choices": [], "usage": usage}


def wants_usage(body) -> bool:
    """`stream_options.include_usage`: a last chunk with the usage and no choices."""
    return body.stream_options is not None and body.stream_options.include_usage


async def stream_choices(
    job: Job,
    shape: ChunkShape,
    opening: Iterable[dict],
    make_chunk: Callable[[int, Response], dict | None],
    usage: Callable[[], dict] | None,
) -> AsyncIterator[str]:
    """The SSE events of a chat or completions stream: the `opening` chunks, then for each
    of the engine's deltas `make_chunk(choice index, delta)` (None: nothing to send), an
    error event for a choice that failed, the usage chunk when `usage` is given, and
    `data: [DONE]`."""
    for chunk in opening:
        yield SSE.event(chunk)
    async for i, delta in job.responses():
        if delta.finish_reason == "error":
            yield SSE.event(generation_error(delta.error or "generation failed").body())
            continue
        chunk = make_chunk(i, delta)
        if chunk is not None:
            yield SSE.event(chunk)
    if usage is not None:
        yield SSE.event(shape.usage_chunk(usage()))
    yield SSE.done
