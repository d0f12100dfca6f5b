"""What one engine step did, for whoever watches the engine: benchmarks, /metrics, tools.

`Engine.add_observer(fn)` calls `fn(report)` on the loop thread after every step, with a
`StepReport` of plain data: what was scheduled (per sequence, by request id), the step's timing,
the requests it took in and ended, and the scheduler's counters. Observers must be quick and
must not call back into the engine; one that raises is logged and dropped. With no observer,
no report is built.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lmengine.scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class ScheduledWork:
    """One sequence's share of a step."""

    request_id: int
    seq_id: int
    start_pos: int  # tokens already in the cache when the step started
    num_new_tokens: int  # tokens computed this step (a prompt chunk, or one)
    needs_sample: bool  # the step sampled a token for it
    num_generated_tokens: int  # after the step


@dataclass
class StepReport:
    step: int  # numbered from 1 (Engine.stats()["num_steps"])
    started: float  # time.monotonic()
    seconds: float
    scheduled: list[ScheduledWork] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0  # of chunks longer than one token
    num_preempted: int = 0  # by recompute or swap, this step
    added: list[int] = field(default_factory=list)  # requests taken in since the last step
    ended: list[int] = field(default_factory=list)  # requests whose last Response went out
    error: str | None = None  # the step failed (its requests ended with this error)
    # with a latency target (EngineConfig.max_step_ms), the seconds the scheduler predicted
    predicted_seconds: float | None = None
    stats: Callable[[], dict] | None = field(default=None, repr=False)

    @functools.cached_property
    def counters(self) -> dict:
        """`Scheduler.stats()` after the step, built when first read (inside the observer
        call: it reads the scheduler, which only the loop thread may)."""
        return self.stats() if self.stats is not None else {}


def step_report(
    step: int,
    started: float,
    out: SchedulerOutput | None,
    added: list[int],
    ended: list[int],
    error: str | None,
    stats: Callable[[], dict],
) -> StepReport:
    """The report of a step that ran `out` (None: scheduling itself failed)."""
    seconds = time.monotonic() - started
    report = StepReport(step, started, seconds, added=added, ended=ended, error=error, stats=stats)
    if out is not None:
        report.scheduled = [
            ScheduledWork(
                it.seq.request_id,
                it.seq.seq_id,
                it.start_pos,
                it.num_new_tokens,
                it.needs_sample,
                it.seq.num_generated_tokens,
            )
            for it in out.scheduled
        ]
        report.num_batched_tokens = out.num_batched_tokens
        report.num_prefill_tokens = out.num_prefill_tokens
        report.num_preempted = len(out.preempted) + len(out.swapped_out)
        report.predicted_seconds = out.predicted_seconds
    return report
