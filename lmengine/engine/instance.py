"""EngineInstance: the per-caller handle. Use one per thread, or share one: it keeps no state
besides the engine it talks to."""

from __future__ import annotations

from collections.abc import Iterator

from lmengine.config import GenerationConfig
from lmengine.engine.request import Answer, Response


class EngineInstance:
    def __init__(self, engine) -> None:
        self.engine = engine

    def stream_infer(
        self,
        session_id: int,
        input_ids: list[int],
        gen_config: GenerationConfig | None = None,
        adapter_name: str | None = None,
        priority: int | None = None,
        user_id: str | None = None,
    ) -> Iterator[Response]:
        """Yield a Response with every token so far after every generated token; the last
        has a finish_reason. The session id is the request's id in the engine: a session
        runs one request at a time.

        Closing the iterator early cancels the request. A beam-search request (`num_beams > 1`)
        yields its final Response only: its beams have no stable prefix to stream.
        """
        options = dict(adapter_name=adapter_name, priority=priority, user_id=user_id)
        answer = Answer()
        for delta in self._deltas(session_id, input_ids, gen_config, **options):
            answer.add(delta)
            yield answer.response()

    def infer(self, session_id: int, input_ids: list[int], **kwargs) -> Response:
        """Run to completion and return the final Response."""
        answer = Answer()
        for delta in self._deltas(session_id, input_ids, **kwargs):
            answer.add(delta)
        return answer.response(copy=False)

    def _deltas(
        self,
        session_id: int,
        input_ids: list[int],
        gen_config: GenerationConfig | None = None,
        **options,
    ) -> Iterator[Response]:
        """The engine's deltas of one request until its last; closing early cancels it.
        `options`: the request's adapter_name, priority and user_id."""
        client = self.engine.client
        yield from client.stream(
            client.request(input_ids, gen_config, request_id=session_id, **options)
        )

    def cancel(self, session_id: int) -> None:
        """Stop the session's running request; its stream ends with finish_reason 'cancel'."""
        self.engine.client.cancel(session_id)

    def end(self, session_id: int) -> None:
        """End the session: cancel whatever it runs (the engine keeps nothing else of a
        session; its KV blocks stay in the prefix cache when that is on)."""
        self.engine.client.cancel(session_id)
