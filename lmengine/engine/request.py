"""Requests and responses, and the RequestManager: the only door between threads.

Any thread submits; the engine loop thread drains. Every request is validated once, here, in
the submitting thread: an invalid one is answered at once with `finish_reason="error"` and
never reaches the engine. Each add request carries its own response queue.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmengine.config import GenerationConfig


@dataclass
class RequestMetrics:
    """Where a request waited before its first token, in engine steps and in seconds of
    `time.monotonic()`: submitted (any thread), taken by the engine loop, first scheduled,
    first token sampled. Steps are numbered from 1 as the engine starts them
    (`Engine.stats()["num_steps"]`); `submit_step` is the step running (or last run) when the
    request was submitted, so the first token of a request that is admitted at once comes
    from step `submit_step + 1`."""

    submit_step: int = 0
    submit_time: float = 0.0
    arrival_time: float | None = None
    first_scheduled_step: int | None = None
    first_scheduled_time: float | None = None
    first_token_step: int | None = None
    first_token_time: float | None = None

    @property
    def steps_to_first_token(self) -> int | None:
        """Steps from submission to the first token, counting the one running at submission."""
        if self.first_token_step is None:
            return None
        return self.first_token_step - self.submit_step + 1


@dataclass
class Response:
    """One update of a request. `token_ids` holds every token generated so far.

    A response queue shared by several requests may receive a list of Responses (one step's
    updates at once); a queue owned by one request receives Response objects only."""

    text: str | None = None  # decoded generated text so far (stop words removed)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None while running; "stop", "length", "cancel", "error"
    input_token_len: int = 0
    generate_token_len: int = 0
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    index: int = 0  # position of the prompt in a pipeline batch
    error: str | None = None  # message when finish_reason == "error"
    session_id: int | None = None
    # speculative decoding: tokens drafted for this request so far, and how many were kept
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # beam search (num_beams > 1): the num_return_sequences best hypotheses, best first, and
    # their scores (sum of logprobs / generated_len ** length_penalty, as transformers)
    beam_token_ids: list[list[int]] | None = None
    beam_scores: list[float] | None = None
    beam_texts: list[str] | None = None
    # research hooks (GenerationConfig.prompt_logprobs / output_hidden_states): per prompt
    # token {token_id: logprob} holding that token and the top N (None for the first token);
    # per asked layer the hidden states [num_positions, hidden] of the positions run so far
    prompt_logprobs: list[dict[int, float] | None] | None = None
    hidden_states: dict[int, Any] | None = None  # layer -> torch.Tensor, on the CPU
    metrics: RequestMetrics | None = None  # the request's wait for its first token


@dataclass
class AddRequest:
    session_id: int
    input_ids: list[int]
    gen_config: GenerationConfig
    response_queue: queue.Queue
    adapter_name: str | None = None
    priority: int | None = None
    user_id: str | None = None
    index: int = 0
    research: Any = None  # ResearchSpec, set by the validator when the request asks for one
    grammar: Any = None  # compiled structured_outputs, set by the validator
    metrics: RequestMetrics = field(default_factory=RequestMetrics)  # stamped by the engine


@dataclass
class CancelRequest:
    session_id: int


@dataclass
class EndRequest:
    session_id: int


@dataclass
class CallRequest:
    """Run `fn()` on the engine loop thread (inspection from tests and tools)."""

    fn: Callable[[], Any]
    result_queue: queue.Queue


Request = AddRequest | CancelRequest | EndRequest | CallRequest


class RequestError(ValueError):
    """A request the engine refuses; its message is the `error` of the response."""


class FatalEngineError(RuntimeError):
    """A failure the engine cannot contain to one step (a tensor-parallel rank lost mid-step):
    the loop stops and every waiting caller gets an error."""


# the start of the error of a request whose step raised: an engine bug, not the request's fault
STEP_FAILED = "the step running this request failed"


def error_response(req: AddRequest, message: str) -> Response:
    return Response(
        finish_reason="error",
        error=message,
        input_token_len=len(req.input_ids) if isinstance(req.input_ids, list) else 0,
        index=req.index,
        session_id=req.session_id,
    )


class RequestManager:
    """Thread-safe inbox for requests; tracks outstanding add requests so that, if the loop
    dies or the engine closes, every waiting caller gets an error instead of hanging."""

    def __init__(
        self,
        validate: Callable[[AddRequest], None] | None = None,
        current_step: Callable[[], int] = lambda: 0,
    ) -> None:
        """`validate` refuses a request in the submitting thread; `current_step` is the
        engine's step counter, stamped on every add request."""
        self._current_step = current_step
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._validate = validate
        self._lock = threading.Lock()
        self._outstanding: dict[int, AddRequest] = {}  # id(request) -> request
        self._closed_reason: str | None = None
        self._wakeup = threading.Event()

    # ---- any thread ---------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if isinstance(req, AddRequest):
            req.metrics.submit_time = time.monotonic()
            req.metrics.submit_step = self._current_step()
            try:
                if self._validate is not None:
                    self._validate(req)
            except RequestError as e:
                req.response_queue.put(error_response(req, str(e)))
                return
            with self._lock:
                if self._closed_reason is not None:
                    req.response_queue.put(error_response(req, self._closed_reason))
                    return
                self._outstanding[id(req)] = req
        elif self._closed_reason is not None:
            if isinstance(req, CallRequest):
                req.result_queue.put((False, RuntimeError(self._closed_reason)))
            return
        self._inbox.put(req)
        self._wakeup.set()

    def num_pending(self) -> int:
        """Requests submitted and not yet taken by the loop."""
        return self._inbox.qsize()

    # ---- the engine loop thread ---------------------------------------------------------------
    def drain(self, block: bool, timeout: float = 0.05) -> list[Request]:
        """All pending requests; waits up to `timeout` for the first one when `block`."""
        if block and self._inbox.empty():
            self._wakeup.wait(timeout)
        self._wakeup.clear()
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def publish_many(self, pairs: list[tuple[AddRequest, Response]]) -> None:
        """Deliver one step's responses. Requests that share a queue (a pipeline batch) get
        one list per step instead of one item per response.

        NOTE: every wake-up of a consumer thread during a forward steals a core from the
        compute threads; one wake-up per step instead of one per sequence kept a 64-sequence
        decode step from slowing down by a quarter on 2 cores.
        """
        by_queue: dict[int, list[Response]] = {}
        queues: dict[int, queue.Queue] = {}
        finished = []
        for req, response in pairs:
            response.index = req.index
            response.session_id = req.session_id
            if response.finish_reason is not None:
                finished.append(req)
            by_queue.setdefault(id(req.response_queue), []).append(response)
            queues[id(req.response_queue)] = req.response_queue
        if finished:
            with self._lock:
                for req in finished:
                    self._outstanding.pop(id(req), None)
        for key, responses in by_queue.items():
            queues[key].put(responses[0] if len(responses) == 1 else responses)

    def deliver(self, req: AddRequest, response: Response) -> None:
        """Put one final Response straight into the request's queue (a refused, cancelled or
        failed request): the failure path, which must not depend on `publish_many`, since
        that may be what failed."""
        response.index = req.index
        response.session_id = req.session_id
        with self._lock:
            self._outstanding.pop(id(req), None)
        req.response_queue.put(response)

    def close(self, reason: str) -> None:
        """Refuse new requests and answer every outstanding one with an error."""
        with self._lock:
            self._closed_reason = reason
            pending, self._outstanding = list(self._outstanding.values()), {}
        for req in self.drain(block=False):
            if isinstance(req, AddRequest) and all(req is not p for p in pending):
                pending.append(req)
            elif isinstance(req, CallRequest):
                req.result_queue.put((False, RuntimeError(reason)))
        for req in pending:
            req.response_queue.put(error_response(req, reason))
        self._wakeup.set()

    def wake(self) -> None:
        self._wakeup.set()


def new_queue() -> queue.Queue[Any]:
    return queue.Queue()
