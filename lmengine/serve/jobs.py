"""The bridge between the engine thread and the server's event loop.

Every HTTP request becomes a `Job`: one engine request per choice (n x prompts), each with its
own engine request id. All jobs share one `ResponseRouter` as their response queue, so the
engine wakes the event loop once per step (not once per request), and the router hands each
Response to its job by request id. A job that is cancelled (client gone, timeout, shutdown)
cancels its engine requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from lmengine.config import GenerationConfig
from lmengine.engine.client import Client
from lmengine.engine.request import AddRequest, Answer, Response
from lmengine.serve.errors import ENGINE_GONE, APIError, engine_error
from lmengine.serve.metrics import ServerMetrics


class ResponseRouter:
    """The response queue of every engine request the server makes (it only needs `put`).

    The engine puts one Response or one list of Responses per step from its thread; the
    router moves them to the event loop in one hand-off and dispatches them by request id.
    It never reads a response; a response for no known job (already finished) is dropped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()  # NOTE: built on the event loop's thread
        self.jobs: dict[int, Job] = {}  # engine request id -> job

    def put(self, item: Response | list[Response]) -> None:
        if threading.get_ident() == self.loop_thread:  # a refusal inside submit()
            self._dispatch(item)
        else:
            self.loop.call_soon_threadsafe(self._dispatch, item)

    def _dispatch(self, item: Response | list[Response]) -> None:
        for resp in item if isinstance(item, list) else (item,):
            job = self.jobs.get(resp.request_id)
            if job is not None:
                job.on_response(resp)


def timed_out() -> APIError:
    """The answer to a request that passed `--request-timeout`."""
    return APIError(504, "request timed out", "timeout", "timeout")


@dataclass
class Choice:
    """One engine request of a job: its prompt, config, its answer assembled from the
    engine's deltas, and its first delta and whole last Response. Plain data; only its Job
    updates it."""

    request_id: int
    input_ids: list[int]
    gen_config: GenerationConfig
    answer: Answer = field(default_factory=Answer)
    first: Response | None = None  # its first delta
    final: Response | None = None  # its whole answer, once finished
    first_time: float | None = None
    last_token_time: float | None = None  # when its latest token reached the event loop
    max_gap: float = 0.0  # the longest wait between two of its tokens (goodput)
    is_done: bool = False


class Job:
    """The engine requests of one HTTP request, and the stream of their responses.

    Owns its choices, their response queue and their server metrics; it submits and cancels
    through the engine's client (its front door) only and never formats an answer (the
    routes do).
    """

    def __init__(
        self,
        client: Client,
        router: ResponseRouter,
        metrics: ServerMetrics,
        endpoint: str,
        timeout: float | None,
        received: float | None = None,
        arrived: Callable[[], None] | None = None,
    ) -> None:
        """`received`: when the HTTP request arrived (time.monotonic(); default: now), where
        its time to first token starts; `arrived`: told once the job has submitted (the
        engine waits for announced arrivals: `Client.expect_arrival`)."""
        self.client, self.router, self.metrics, self.endpoint = client, router, metrics, endpoint
        self.choices: list[Choice] = []
        self.by_request: dict[int, int] = {}  # engine request id -> choice index
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice index, Response) or None (woken)
        self.start = received if received is not None else time.monotonic()
        self.deadline = self.start + timeout if timeout else None
        self.num_started = 0
        self.num_done = 0
        self.started = asyncio.Event()  # a choice has its first response
        self.cancel_reason: str | None = None
        self.arrived = arrived

    # ---- submission ---------------------------------------------------------------------------
    def submit(self, requests: list[AddRequest]) -> None:
        """Send the job's engine requests (checked already, built with the router as their
        queue, one per choice in order)."""
        for req in requests:
            self.by_request[req.request_id] = len(self.choices)
            self.choices.append(Choice(req.request_id, req.input_ids, req.gen_config))
            self.router.jobs[req.request_id] = self
        self.metrics.num_in_flight += len(self.choices)
        self.metrics.num_queued += len(self.choices)
        for req in requests:
            self.client.submit(req)
            if self.cancel_reason is not None:
                break  # refused before the others were sent: they are cancelled already
        if self.arrived is not None:
            self.arrived()

    # ---- the event loop: responses ------------------------------------------------------------
    def on_response(self, resp: Response) -> None:
        index = self.by_request.get(resp.request_id)
        if index is None:
            return
        choice = self.choices[index]
        if choice.is_done:
            return
        now = time.monotonic()
        choice.answer.add(resp)
        if resp.token_ids:
            if choice.last_token_time is not None:
                choice.max_gap = max(choice.max_gap, now - choice.last_token_time)
            choice.last_token_time = now
        if choice.first is None:
            choice.first, choice.first_time = resp, now
            self.metrics.num_queued -= 1
            if resp.generate_token_len > 0:
                self.metrics.ttft.observe(now - self.start)
                self.metrics.observe_first_token(self.start, resp.metrics, now)
            self.num_started += 1
            self.started.set()
            if resp.finish_reason == "error" and resp.generate_token_len == 0:
                # refused: the whole request fails, its other choices are cancelled
                self.queue.put_nowait((index, resp))
                self._finish(choice, choice.answer.response(copy=False), now)
                self.cancel("refused")
                return
        if resp.finish_reason is not None:
            self._finish(choice, choice.answer.response(copy=False), now)
        self.queue.put_nowait((index, resp))

    def _finish(self, choice: Choice, resp: Response, now: float) -> None:
        choice.final, choice.is_done = resp, True
        self.router.jobs.pop(choice.request_id, None)
        self.num_done += 1
        m = self.metrics
        m.num_in_flight -= 1
        m.count_request(self.endpoint, resp.finish_reason or "cancel")
        m.prompt_tokens += resp.input_token_len
        m.generation_tokens += resp.generate_token_len
        if resp.finish_reason in ("stop", "length"):
            m.e2e.observe(now - self.start)
            if choice.first_time is not None and resp.generate_token_len > 0:
                m.observe_slo(choice.first_time - self.start, choice.max_gap)
            if resp.generate_token_len > 1 and choice.first_time is not None:
                m.tpot.observe((now - choice.first_time) / (resp.generate_token_len - 1))

    def cancel(self, reason: str) -> None:
        """Stop every unfinished choice (frees its blocks in the engine) and wake waiters."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
        now = time.monotonic()
        for choice in self.choices:
            if choice.is_done:
                continue
            self.client.cancel(choice.request_id)
            if choice.first is None:
                self.metrics.num_queued -= 1
                choice.first = Response(finish_reason="cancel")
            self._finish(choice, Response(finish_reason="cancel"), now)
        self.started.set()
        self.queue.put_nowait(None)

    @property
    def is_done(self) -> bool:
        return self.num_done == len(self.choices)

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    # ---- the event loop: waiting --------------------------------------------------------------
    async def wait_started(self) -> None:
        """Wait for the first response of the job (a token, or the engine's refusal: then
        raise its HTTP error). NOTE: choices share prompt and config, so the engine refuses
        all or none of them; a refusal of one cancels the others."""
        try:
            await asyncio.wait_for(self.started.wait(), self.remaining())
        except TimeoutError:
            self.cancel("timeout")
            raise timed_out() from None
        for choice in self.choices:
            first = choice.first
            if first is not None and first.finish_reason == "error" and not first.token_ids:
                raise engine_error(first.error or "request failed")
        if self.cancel_reason is not None and self.cancel_reason != "refused":
            raise self.cancel_error() or APIError(
                499, f"request cancelled: {self.cancel_reason}", code="cancelled"
            )

    def cancel_error(self) -> APIError | None:
        """The error a cancelled job answers with (None: a cancel the client asked for)."""
        if self.cancel_reason == "timeout":
            return timed_out()
        if self.cancel_reason == "server shutdown":
            return APIError(
                503, "the server shut down before the request finished", "service_unavailable"
            )
        if self.cancel_reason is not None and self.cancel_reason.startswith(ENGINE_GONE):
            return engine_error(self.cancel_reason)  # the engine died: 503
        return None

    async def responses(self) -> AsyncIterator[tuple[int, Response]]:
        """(choice index, the engine's delta) until every choice has finished; raises APIError(504)
        when the request's timeout passes (after cancelling it)."""
        while True:
            if self.queue.empty() and self.is_done:
                return
            try:
                item = await asyncio.wait_for(self.queue.get(), self.remaining())
            except TimeoutError:
                self.cancel("timeout")
                raise timed_out() from None
            if item is None:
                err = self.cancel_error()
                if err is not None:
                    raise err
                continue
            yield item

    async def watch_disconnect(self, request) -> None:
        """Cancel the job when the HTTP client goes away (run as a task while waiting).

        NOTE: the body is read by now, so the next ASGI message is the disconnect: waiting
        for it costs nothing, where polling woke the event loop 20 times a second per
        request, each time taking a core from the engine's compute threads."""
        while not self.is_done:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.cancel("client disconnected")
                return
