"""Requests and responses, and the RequestManager: the only door between threads.

Any thread submits; the engine loop thread drains. Every request is validated once, here, in
the submitting thread: an invalid one is answered at once with `finish_reason="error"` and
never reaches the engine. Each add request carries its own response queue.

Inside the engine a request is known by its `request_id`. `EngineInstance` uses the caller's
session id (lmdeploy's name: a conversation, one running request at a time) as the request
id; the pipeline and the server draw fresh ids from `Engine.new_request_id`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmengine.config import GenerationConfig

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from lmengine.engine.research import ResearchSpec


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
    """One update of a request.

    The engine publishes deltas: `token_ids`, `logprobs` and `text` hold what is new since
    the request's previous Response (the counts, `generate_token_len` and the draft counts,
    are totals). An `Answer` assembles them; `EngineInstance.stream_infer` yields the
    assembled Response (every token so far), `Pipeline.stream_infer` the deltas.

    A response queue shared by several requests may receive a list of Responses (one step's
    updates at once); a queue owned by one request receives Response objects only."""

    text: str | None = None  # decoded generated text (stop words removed)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None while running; "stop", "length", "cancel", "error"
    input_token_len: int = 0
    generate_token_len: int = 0
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    index: int = 0  # position of the prompt in a pipeline batch
    error: str | None = None  # message when finish_reason == "error"
    request_id: int | None = None  # the request this answers (EngineInstance: its session id)
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
    # GenerationConfig.pooling: the final norm's output pooled over the prompt [hidden],
    # float32 on the CPU, in the request's final Response
    embedding: Any = None
    # vLLM's stop_reason: the stop word or stop token id that ended the request (finish
    # reason "stop"); None when it ended at an end-of-sequence token, a length or an error
    stop_reason: str | int | None = None
    metrics: RequestMetrics | None = None  # the request's wait for its first token

    @property
    def session_id(self) -> int | None:
        """lmdeploy's name of `request_id`, as `EngineInstance` callers know it."""
        return self.request_id


class Answer:
    """A request's answer assembled from its deltas, in time and memory linear in its length:
    the token ids, logprobs and text so far, and the latest delta's other fields."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = None
        self._texts: list[str] | None = None  # NOTE: joined when read, then kept joined
        self.last: Response | None = None

    def add(self, delta: Response) -> None:
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.text is not None:
            if self._texts is None:
                self._texts = []
            self._texts.append(delta.text)
        self.last = delta

    @property
    def text(self) -> str | None:
        if self._texts is None:
            return None
        if len(self._texts) > 1:
            self._texts = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def response(self, copy: bool = True) -> Response:
        """The answer so far as one Response (every token so far): copies of its lists, or
        the lists themselves (`copy=False`: once, when nothing is added after)."""
        assert self.last is not None, "no Response yet"
        tokens, logprobs = self.token_ids, self.logprobs
        if copy:
            tokens, logprobs = list(tokens), list(logprobs) if logprobs is not None else None
        return dataclasses.replace(self.last, text=self.text, token_ids=tokens, logprobs=logprobs)


@dataclass
class AddRequest:
    request_id: int
    input_ids: list[int]
    gen_config: GenerationConfig
    response_queue: queue.Queue
    adapter_name: str | None = None
    priority: int | None = None
    user_id: str | None = None
    index: int = 0
    # set by the validator (RequestValidator.validate), the one place that creates them
    research: ResearchSpec | None = None  # what the request asks of the forward
    grammar: CompiledGrammar | None = None  # its compiled structured_outputs
    metrics: RequestMetrics = field(default_factory=RequestMetrics)  # stamped by the engine
    validated: bool = False  # checked already (Client.check): submit takes it as it is


@dataclass
class CancelRequest:
    """Stop the request, free what it holds; its last Response says "cancel"."""

    request_id: int


@dataclass
class CallRequest:
    """Run `fn()` on the engine loop thread (inspection from tests and tools)."""

    fn: Callable[[], Any]
    result_queue: queue.Queue


Request = AddRequest | CancelRequest | CallRequest


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
        request_id=req.request_id,
    )


class RequestManager:
    """Thread-safe inbox for requests. It holds a request only until the loop drains it: from
    then on the engine's record of it (`Engine.requests`) is its only state. `close` refuses
    new requests and answers those still in the inbox; the engine answers its own."""

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
        self._lock = threading.Lock()  # NOTE: a request enters the inbox or is refused, whole
        self._closed_reason: str | None = None
        self._wakeup = threading.Event()
        self._arriving = 0  # requests a front door has received and not yet submitted

    def expect_arrival(self) -> Callable[[], None]:
        """Count one request that a front door has received and is still preparing (reading,
        tokenizing); the function returned stops counting it, once, however often called
        (call it after submitting, and again wherever the request may end unsubmitted)."""
        with self._lock:
            self._arriving += 1
        counted = True

        def done() -> None:
            nonlocal counted
            with self._lock:
                if not counted:
                    return
                counted = False
                self._arriving -= 1
            self._wakeup.set()  # an engine gathering a burst looks again

        return done

    def num_arriving(self) -> int:
        """Requests received by a front door and not yet submitted (`expect_arrival`)."""
        return self._arriving

    # ---- the engine loop thread ---------------------------------------------------------------
    def burst(
        self, wait_s: float, gap_s: float, waiting: Sized, enough: Callable[[], bool]
    ) -> Iterator[list[Request]]:
        """The rest of a burst arriving at an idle engine, as it comes (each list drained), until
        `enough()` (a step's worth waits, or the engine stops: `wake` ends a wait): while
        requests are announced (`expect_arrival`), and once two or more are `waiting` (the
        scheduler's queue; a lone request never waits) as long as they keep coming less than
        `gap_s` apart; for `wait_s` at most."""
        last = time.monotonic()  # when the latest request came
        deadline = last + wait_s
        while not enough():
            if self.num_arriving():
                until = deadline
            elif len(waiting) >= 2:
                until = min(deadline, last + gap_s)
            else:
                return
            left = until - time.monotonic()
            if left <= 0:
                return
            got = self.drain(block=True, timeout=left)
            if got:
                last = time.monotonic()
            yield got

    # ---- any thread ---------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if isinstance(req, AddRequest):
            req.metrics.submit_time = time.monotonic()
            req.metrics.submit_step = self._current_step()
            try:
                if self._validate is not None and not req.validated:
                    self._validate(req)
            except RequestError as e:
                req.response_queue.put(error_response(req, str(e)))
                return
        with self._lock:
            if self._closed_reason is None:
                self._inbox.put(req)
                self._wakeup.set()
                return
            reason = self._closed_reason
        if isinstance(req, AddRequest):
            req.response_queue.put(error_response(req, reason))
        elif isinstance(req, CallRequest):
            req.result_queue.put((False, RuntimeError(reason)))

    def num_pending(self) -> int:
        """Requests submitted and not yet taken by the loop."""
        return self._inbox.qsize()

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

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
        for req, response in pairs:
            response.index = req.index
            response.request_id = req.request_id
            by_queue.setdefault(id(req.response_queue), []).append(response)
            queues[id(req.response_queue)] = req.response_queue
        for key, responses in by_queue.items():
            queues[key].put(responses[0] if len(responses) == 1 else responses)

    def deliver(self, req: AddRequest, response: Response) -> None:
        """Put one final Response straight into the request's queue (a refused, cancelled or
        failed request): the failure path, which must not depend on `publish_many`, since
        that may be what failed."""
        response.index = req.index
        response.request_id = req.request_id
        req.response_queue.put(response)

    def close(self, reason: str) -> None:
        """Refuse new requests and answer every one still in the inbox with an error (the
        first reason given stays)."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = reason
            reason = self._closed_reason
            pending = self.drain(block=False)
        for req in pending:
            if isinstance(req, AddRequest):
                req.response_queue.put(error_response(req, reason))
            elif isinstance(req, CallRequest):
                req.result_queue.put((False, RuntimeError(reason)))
        self._wakeup.set()

    def wake(self) -> None:
        self._wakeup.set()


def new_queue() -> queue.Queue[Any]:
    return queue.Queue()
