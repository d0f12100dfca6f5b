"""How much of a prompt one step computes, within the step's prefill budget: a number of
prompt tokens, and with a latency target a predicted time (step_cost.py)."""

from __future__ import annotations

import math

from lmengine.scheduler.output import SchedulerOutput
from lmengine.scheduler.sequence import Sequence
from lmengine.scheduler.step_cost import StepCostModel

# NOTE: a prompt's first token comes with the step that computes its last chunk. Cutting a step
# exactly at the budget leaves the prompt that straddles it a short tail, and its first token a
# whole step later, to save a few percent of this step. A burst of 64 prompts of 100 tokens at
# 1,024 tokens a step finished ten prompts per step instead of eleven, and its median first
# token (vllm bench serve, all at once) came a step later (docs/serving_latency.md). Steps may
# run over the budget by this share of it instead.
PREFILL_SLACK = 1 / 8


def prefill_chunk(num_new: int, left: int, budget: int) -> int:
    """Prompt tokens to compute this step for a sequence with `num_new` not computed yet, when
    `left` of the step's `budget` remain: all of them if they overrun `left` by at most the
    slack, else as many as are left (0 when none)."""
    if left > 0 and num_new <= left + int(budget * PREFILL_SLACK):
        return num_new
    return max(0, min(num_new, left))


# with a latency target, the first prefill chunk of a step gets at least this many tokens even
# when the running decodes use up the step's time, so that a prompt always progresses
MIN_PREFILL_CHUNK = 64


class StepBudget:
    """What one step has left for prompt chunks: tokens (`max_tokens` a step, as
    `prefill_chunk` spends them) and, with a latency target `max_step_s`, predicted seconds:
    the target minus the fixed cost and the running decodes' cost, spent chunk by chunk by
    the `StepCostModel` fitted from the engine's steps. Decodes always run; the first chunk
    of a step gets at least MIN_PREFILL_CHUNK tokens. Owned by the Scheduler."""

    def __init__(self, max_tokens: int, max_step_s: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.max_step_s = max_step_s
        self.cost = StepCostModel()
        self.tokens_left = 0
        self.seconds_left = math.inf  # inf: no time budget (none asked, or not learned yet)
        self.num_chunks = 0

    @property
    def timed(self) -> bool:
        return bool(self.max_step_s) and self.cost.ready

    def begin(self, running: list[Sequence]) -> None:
        """A new step after these running sequences (their decodes are predicted first)."""
        self.tokens_left, self.num_chunks = self.max_tokens, 0
        self.seconds_left = math.inf
        if self.timed:  # NOTE: nothing to predict, so nothing built, without a target
            decodes = [(s.num_computed_tokens, 1) for s in running if s.num_uncomputed == 1]
            self.seconds_left = self.max_step_s - self.cost.predict(decodes)

    def chunk(self, start: int, num_new: int) -> int:
        """Tokens a sequence with `num_new` not computed after `start` computes this step: 1
        for a decode (always), else a prompt chunk within what is left (0 when nothing)."""
        if num_new <= 1:
            return num_new
        n = prefill_chunk(num_new, self.tokens_left, self.max_tokens)
        if self.seconds_left != math.inf:
            fits = self.cost.max_chunk(start, self.seconds_left)
            if self.num_chunks == 0:
                fits = max(fits, MIN_PREFILL_CHUNK)
            n = min(n, fits)
        return n

    def spend(self, start: int, num_new: int, sign: int = 1) -> None:
        """Count a scheduled chunk (`sign` -1: give a chunk taken back out of the step)."""
        if num_new <= 1:
            return
        self.tokens_left -= sign * num_new
        self.num_chunks += sign
        if self.seconds_left != math.inf:
            self.seconds_left -= sign * self.cost.chunk_seconds(start, num_new)

    def predict(self, out: SchedulerOutput) -> float | None:
        """Predicted seconds of the step `out`, when timed."""
        return self.cost.predict(out.chunks) if self.timed else None

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """Learn from a step that ran `out` in `seconds` (only with a target: the step's
        chunks are not even listed without one)."""
        if self.max_step_s:
            self.cost.observe(out.chunks, seconds)
