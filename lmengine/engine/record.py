"""The engine's record of one request: the only place its state lives while it runs.

`Engine.requests` maps a request id to its record; the engine loop thread creates, reads and
drops records, and nothing else holds a request. Each part has one writer:

- `request`: what the caller asked (the validated AddRequest), never changed;
- `seq`: its Sequence (the Scheduler owns sequences and blocks; a beam request's first);
- `output`: what the output stage made so far (text, logprobs, research results);
- `beams`: a beam request's group (BeamSearch's arithmetic), None otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmengine.engine.request import AddRequest
from lmengine.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from lmengine.engine.beam import BeamGroup
    from lmengine.engine.output_stage import OutputState


@dataclass(eq=False)
class RequestRecord:
    request: AddRequest
    seq: Sequence
    output: OutputState
    beams: BeamGroup | None = None

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def sequences(self) -> list[Sequence]:
        """Every live sequence of the request (its beams, or its one sequence)."""
        return list(self.beams.beams) if self.beams is not None else [self.seq]

    def best_sequence(self) -> Sequence:
        """The sequence whose tokens a cancelled or failed request answers with."""
        return self.beams.beams[0] if self.beams is not None else self.seq
