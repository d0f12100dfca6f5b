"""The engine's front door: how every front end submits, streams and cancels requests.

`EngineInstance`, the `Pipeline` and the server's jobs all go through one `Client`
(`engine.client`); nothing outside `lmengine/engine/` touches the RequestManager, the
Scheduler or the ModelAgent. A request is built once (`request`), may be checked before it is
queued (`check`: the server answers 400 before it counts a request against its queue limit),
and is validated once either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from lmengine.config import GenerationConfig
from lmengine.engine.request import AddRequest, CancelRequest, Response, new_queue

if TYPE_CHECKING:
    from lmengine.engine.engine import Engine


class Client:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def request(
        self,
        input_ids: list[int],
        gen_config: GenerationConfig | None = None,
        *,
        request_id: int | None = None,
        response_queue: Any = None,
        index: int = 0,
        adapter_name: str | None = None,
        priority: int | None = None,
        user_id: str | None = None,
    ) -> AddRequest:
        """A request, not yet submitted: a fresh id unless given, a queue of its own unless
        given (anything with `put`: one Response, or one list of them per step)."""
        return AddRequest(
            request_id=request_id if request_id is not None else self._engine.new_request_id(),
            input_ids=list(input_ids) if isinstance(input_ids, tuple) else input_ids,
            gen_config=gen_config if gen_config is not None else GenerationConfig(),
            response_queue=response_queue if response_queue is not None else new_queue(),
            adapter_name=adapter_name,
            priority=priority,
            user_id=user_id,
            index=index,
        )

    def check(self, req: AddRequest) -> None:
        """Validate `req` now (RequestError says why it can never run); `submit` then takes
        it as it is."""
        self._engine.validator.validate(req)
        req.validated = True

    def expect_arrival(self) -> Callable[[], None]:
        """Announce a request received and still being prepared (read, tokenized); call the
        function returned once it is submitted or refused. An idle engine's first step waits
        for announced requests (`EngineConfig.burst_wait_ms`), so that a burst arriving
        together starts in one step."""
        return self._engine.request_manager.expect_arrival()

    def submit(self, req: AddRequest) -> None:
        """Queue `req`; its Responses (deltas) go to its queue. A refused request gets one
        Response with finish_reason "error"."""
        self._engine.request_manager.submit(req)

    def stream(self, req: AddRequest) -> Iterator[Response]:
        """Submit `req` (with a queue of its own) and yield its deltas until the last;
        closing early cancels it."""
        self.submit(req)
        finished = False
        try:
            while not finished:
                resp = req.response_queue.get()
                finished = resp.finish_reason is not None
                yield resp
        finally:
            if not finished:
                self.cancel(req.request_id)

    @property
    def closed_reason(self) -> str | None:
        """Why the engine takes no more requests (None while it does): "engine closed", or
        the failure that stopped it."""
        return self._engine.request_manager.closed_reason

    def cancel(self, request_id: int) -> None:
        """Stop the request; its last delta says "cancel". Nothing happens to one that ended."""
        self._engine.request_manager.submit(CancelRequest(request_id))
