"""What the Scheduler decides for one step: `SchedulerOutput`, one `ScheduledSequence` each.

The engine turns it into the model's `StepInput` (lmengine/engine/step.py) and hands it back
to `Scheduler.update` with the step's results. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmengine.scheduler.adapter_manager import AdapterPlan
from lmengine.scheduler.sequence import Sequence


@dataclass
class ScheduledSequence:
    """One sequence's share of a step."""

    seq: Sequence
    start_pos: int  # tokens already in the cache = position of the first token computed now
    num_new_tokens: int  # tokens computed this step: seq.token_ids[start_pos:start_pos + n]
    needs_sample: bool  # this chunk reaches the sequence's last token: sample the next one
    num_lookahead: int = 0  # speculative decoding: slots allocated past the chunk for drafts

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table


@dataclass
class SchedulerOutput:
    """Everything one step runs, and what the step decided."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)  # batch, in packed order
    num_batched_tokens: int = 0  # sum of num_new_tokens
    num_prefill_tokens: int = 0  # tokens of chunks longer than one token
    preempted: list[Sequence] = field(default_factory=list)  # preempted by recompute this step
    swapped_out: list[Sequence] = field(default_factory=list)  # preempted by swap this step
    swapped_in: list[Sequence] = field(default_factory=list)  # resumed from the host this step
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    # (src, dst) device: the partial last block of a forked sequence (copy-on-write), copied
    # before this step's swaps and forward (see StepInput)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    adapter_plan: AdapterPlan | None = None  # LoRA loads, page tables of scheduled adapters
    finished_seq_ids: list[int] = field(default_factory=list)  # sequences ended since last step
    # with a latency target (and a cost model learned): the step's predicted seconds
    predicted_seconds: float | None = None

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """(start_pos, num_new_tokens) of every scheduled sequence: what the step computes."""
        return [(item.start_pos, item.num_new_tokens) for item in self.scheduled]

    @property
    def request_ids(self) -> set[int]:
        """The requests whose sequences this step runs."""
        return {item.seq.request_id for item in self.scheduled}
