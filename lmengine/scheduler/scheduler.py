"""The Scheduler: which sequences run each step, with which blocks, and who is preempted.

There are no separate prefill and decode phases. Each step every scheduled sequence gets the
tokens it has not computed yet: one for a decode, a chunk of its prompt for a prefill, limited
by `max_prefill_token_num` prompt tokens per step and `max_batch_size` sequences. Running
sequences are served first in policy order; when blocks run out the policy's victim is
preempted by recompute (its blocks freed, its tokens prefilled again later). Waiting
sequences are admitted in policy order while budget and blocks last.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from lmengine.scheduler.adapter_manager import AdapterManager, AdapterPlan
from lmengine.scheduler.block_manager import BlockManager
from lmengine.scheduler.policies import Policy
from lmengine.scheduler.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step."""

    seq: Sequence
    start_pos: int  # tokens already in the cache = position of the first token computed now
    num_new_tokens: int  # tokens computed this step: seq.token_ids[start_pos:start_pos + n]
    needs_sample: bool  # this chunk reaches the sequence's last token: sample the next one

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start_pos : self.start_pos + self.num_new_tokens]

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table


@dataclass
class SchedulerOutput:
    """Everything the ModelAgent needs for one step, and what the step decided."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)  # batch, in packed order
    num_batched_tokens: int = 0  # sum of num_new_tokens
    num_prefill_tokens: int = 0  # tokens of chunks longer than one token
    preempted: list[Sequence] = field(default_factory=list)  # preempted by recompute this step
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    adapter_plan: AdapterPlan | None = None  # LoRA loads, page tables of scheduled adapters

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues, the sessions and the BlockManager.

    Never touches tensors. The engine calls `add_sequence`, `schedule`, `update` and
    `abort_sequence` from its loop thread only.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        policy: Policy,
        max_batch_size: int,
        max_prefill_token_num: int,
        clock=time.monotonic,
        adapter_manager: AdapterManager | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.adapter_manager = adapter_manager
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_prefill_token_num = max_prefill_token_num
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.sessions: dict[int, list[Sequence]] = {}  # session_id -> its live sequences
        self.num_preemptions = 0

    # ---- admission and removal -------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.sessions.setdefault(seq.session_id, []).append(seq)

    def abort_sequence(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is and free its blocks (finished, cancelled, failed)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        if self.adapter_manager is not None:
            self.adapter_manager.release(seq)
        seq.status = SequenceStatus.FINISHED
        live = self.sessions.get(seq.session_id)
        if live is not None and seq in live:
            live.remove(seq)
            if not live:  # NOTE: forget idle sessions, or every request would leave a key
                del self.sessions[seq.session_id]

    def end_session(self, session_id: int) -> list[Sequence]:
        """Abort every live sequence of the session and forget it; returns the aborted ones."""
        seqs = list(self.sessions.pop(session_id, []))
        for seq in seqs:
            self.abort_sequence(seq)
        return seqs

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> Iterable[Sequence]:
        return [*self.running, *self.waiting]

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        prefill_budget = self.max_prefill_token_num
        bm = self.block_manager

        # 1. running sequences, best first; victims come from the tail
        queue = self.policy.order(self.running, now)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > 1:
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    kept.append(seq)  # chunked prefill waits for budget; keeps its blocks
                    continue
            while not bm.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.policy.victim(queue, now) if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
                queue.remove(victim)
            if seq.status != SequenceStatus.RUNNING:
                continue
            bm.allocate(seq, seq.num_computed_tokens + num_new)
            kept.append(seq)
            self._emit(seq, num_new, out)
            if num_new > 1:
                prefill_budget -= num_new
        self.running = kept

        # 2. waiting sequences, only when nothing was preempted (admitting now would thrash)
        if not out.preempted:
            for seq in self.policy.order(self.waiting, now):
                if len(self.running) >= self.max_batch_size or prefill_budget <= 0:
                    break
                num_new = min(seq.num_tokens - seq.num_computed_tokens, prefill_budget)
                if not bm.can_allocate(seq, seq.num_computed_tokens + num_new):
                    break  # NOTE: strict order: nobody overtakes the head of the queue
                # NOTE: adapter residency is a resource like blocks, in the same strict order:
                # a hot adapter cannot starve a cold one by overtaking it
                if self.adapter_manager is not None and not self.adapter_manager.acquire(seq):
                    break
                bm.allocate(seq, seq.num_computed_tokens + num_new)
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self._emit(seq, num_new, out)
                prefill_budget -= num_new
        if self.adapter_manager is not None:
            out.adapter_plan = self.adapter_manager.plan(it.seq.adapter_id for it in out.scheduled)
        return out

    def _emit(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        start = seq.num_computed_tokens
        needs_sample = start + num_new == seq.num_tokens
        out.scheduled.append(ScheduledSequence(seq, start, num_new, needs_sample))
        out.num_batched_tokens += num_new
        if num_new > 1:
            out.num_prefill_tokens += num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop the KV, requeue; the tokens are prefilled again."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def update(
        self,
        out: SchedulerOutput,
        new_tokens: dict[int, int],
        finished: Iterable[Sequence] = (),
    ) -> None:
        """Take a step's results back: the computed chunks are now cached, sampled tokens
        (`seq_id -> token`) are appended, and `finished` sequences release their blocks."""
        for item in out.scheduled:
            seq = item.seq
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted during the step
            seq.num_computed_tokens = item.start_pos + item.num_new_tokens
            token = new_tokens.get(seq.seq_id)
            if token is not None:
                seq.token_ids.append(token)
        for seq in finished:
            self.abort_sequence(seq)

    # ---- observability -----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        stats = {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_free_blocks": bm.device.num_free,
            "num_total_blocks": bm.device.num_blocks,
            "num_preemptions": self.num_preemptions,
        }
        if self.adapter_manager is not None:
            stats.update(self.adapter_manager.stats())
        return stats

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.live_sequences())
        if self.adapter_manager is not None:
            self.adapter_manager.check_integrity(self.live_sequences())
