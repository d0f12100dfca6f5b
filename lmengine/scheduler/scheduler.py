"""The Scheduler: which sequences run each step, with which blocks, and who is preempted.

There are no separate prefill and decode phases. Each step every scheduled sequence gets the
tokens it has not computed yet: one for a decode, a chunk of its prompt for a prefill, limited
by `max_prefill_token_num` prompt tokens per step and `max_batch_size` sequences; with a
latency target `max_step_s`, also by the predicted time a step has left after its decodes,
from a cost model fitted to the engine's own steps (`observe_step`; budget.py, step_cost.py).

1. Running sequences are served first, in serving order; when blocks run out the last one in
   that order (the victim) is preempted: by swap (its KV blocks copied to the host pool, it
   resumes where it stopped) when `eviction_type == "swap"` and the host pool has room, else
   by recompute (its blocks freed, its tokens prefilled again later).
2. If nobody was preempted, swapped and waiting sequences are admitted together in serving
   order (a swapped one resumes before every newer prompt under FCFS) while batch size,
   budget and blocks last; nobody overtakes the head. A head that the policy or its QoS group
   lets outrank running sequences preempts them when there is no room.

Serving order = QoS groups (when on), then tenant shares, then the policy's rank.

With prefix caching (BlockManager(enable_prefix_caching=True)) a waiting sequence first takes
the cached blocks of its longest cached prefix and starts computing after them; each step's
newly full blocks are published in `update` (see prefix_cache.py).

The Scheduler is the only writer of its queues and of the block pools. Others ask it:
`add_sequence`, `remove_sequence`, and for beam search `fork` (a sequence that
shares its parent's KV blocks), `append_token`, `park` and `requeue` (preempt by recompute).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from lmengine.scheduler.adapter_manager import AdapterManager
from lmengine.scheduler.block_manager import BlockManager
from lmengine.scheduler.budget import StepBudget
from lmengine.scheduler.ordering import ServingOrder
from lmengine.scheduler.output import ScheduledSequence, SchedulerOutput
from lmengine.scheduler.policies import Policy
from lmengine.scheduler.qos import QoS
from lmengine.scheduler.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledSequence", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Owns the waiting, running and swapped queues and the BlockManager: sequences and
    blocks, nothing of the requests they belong to (the engine's records hold those).

    Never touches tensors. Every method runs on the engine's loop thread only.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        policy: Policy,
        max_batch_size: int,
        max_prefill_token_num: int,
        clock=time.monotonic,
        eviction_type: str = "recompute",
        qos: QoS | None = None,
        adapter_manager: AdapterManager | None = None,
        num_lookahead_slots: int = 0,
        max_seq_len: int | None = None,
        max_step_s: float = 0.0,
    ) -> None:
        """`num_lookahead_slots`: speculative decoding drafts up to this many tokens per
        decoding sequence, so a decode step allocates slots for them too (never past
        `max_seq_len` tokens or the sequence's `max_new_tokens`)."""
        if eviction_type not in ("recompute", "swap"):
            raise ValueError(f"eviction_type must be 'recompute' or 'swap', got {eviction_type!r}")
        self.block_manager = block_manager
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_prefill_token_num = max_prefill_token_num
        self.budget = StepBudget(max_prefill_token_num, max_step_s)
        self.clock = clock
        self.eviction_type = eviction_type
        self.qos = qos
        self.serving = ServingOrder(policy, qos)
        self.adapter_manager = adapter_manager
        self.num_lookahead_slots = num_lookahead_slots
        self.max_seq_len = max_seq_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0  # by recompute or swap
        self.num_recomputes = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swapped_blocks = 0  # blocks copied to the host, in total
        self.num_arrival_preemptions = 0  # running ones preempted to make room for a waiting one
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (prefill)
        self.num_prefix_cached_tokens = 0  # prompt tokens taken from the prefix cache instead
        self.num_forks = 0  # sequences forked from another (beam search)
        self.num_shared_blocks = 0  # full blocks a fork took by reference instead of a copy
        self.num_cow_copies = 0  # partial last blocks copied for a fork
        self._pending_copies: list[tuple[int, int, Sequence]] = []  # (src, dst, fork) to emit
        self._finished_seq_ids: list[int] = []  # ended since the last schedule

    # ---- admission and removal -------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new sequence. With QoS on, an unplaceable user raises QoSError."""
        if self.qos is not None:
            seq.tenant = self.qos.tenant(seq.user_id)
        if seq.max_seq_len is None:
            seq.max_seq_len = self.max_seq_len
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove_sequence(self, seq: Sequence) -> None:
        """Take `seq` out wherever it is and free its blocks: it finished, was cancelled or
        failed. Idempotent, and safe on a sequence a failed step left half-moved between
        queues."""
        if seq.status != SequenceStatus.FINISHED:
            self._finished_seq_ids.append(seq.seq_id)
        self._dequeue(seq)
        self.block_manager.free(seq)
        if self.adapter_manager is not None:
            self.adapter_manager.release(seq)
        seq.status = SequenceStatus.FINISHED

    def _dequeue(self, seq: Sequence) -> None:
        """Take `seq` out of the queue its status names, or (after a step failed halfway)
        out of whichever queue holds it."""
        named = {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting}
        for queue in (named.get(seq.status, self.swapped), self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
                return
        if seq in self.swapped:
            self.swapped.remove(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def waiting_fill_a_step(self) -> bool:
        """Whether the waiting prompts alone fill a step's prompt-token budget or batch."""
        tokens = sum(seq.num_tokens for seq in self.waiting)
        return tokens >= self.max_prefill_token_num or len(self.waiting) >= self.max_batch_size

    def live_sequences(self) -> Iterable[Sequence]:
        return [*self.running, *self.waiting, *self.swapped]

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        self.budget.begin(self.running)
        bm = self.block_manager
        # last step's forks: their partial blocks are copied before anything else moves
        for src, dst, child in self._pending_copies:
            if dst in child.block_table:
                out.blocks_to_copy.append((src, dst))
                self.num_cow_copies += 1
        self._pending_copies = []

        # 1. running sequences, best first; victims come from the tail
        queue = self.serving.order(self.running, now)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            num_new = self._num_new_tokens(seq)
            if num_new == 0:
                kept.append(seq)  # chunked prefill waits for budget; keeps its blocks
                continue
            num_slots = seq.num_computed_tokens + num_new + self._lookahead(seq, num_new)
            while not bm.can_allocate(seq, num_slots):
                victim = self.serving.victim(queue, now) if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
                queue.remove(victim)
            if seq.status != SequenceStatus.RUNNING:
                continue
            bm.allocate(seq, num_slots)
            kept.append(seq)
            self._emit(seq, num_new, out)
        self.running = kept

        # 2. swapped and waiting sequences, only when nothing was preempted (admitting now
        # would thrash)
        if not (out.preempted or out.swapped_out):
            self._admit(out, now)
        # 3. a stall: nothing runs and the head of the queue does not fit
        if not out.scheduled:
            self._unpark_one(out, now)
        if self.adapter_manager is not None:
            out.adapter_plan = self.adapter_manager.plan(it.seq.adapter_id for it in out.scheduled)
        out.predicted_seconds = self.budget.predict(out)
        return out

    def _num_new_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` computes this step: 1 for a decode, else a chunk within the budget."""
        return self.budget.chunk(seq.num_computed_tokens, seq.num_uncomputed)

    def _lookahead(self, seq: Sequence, num_new: int) -> int:
        """Draft slots for `seq` this step: only a decode (its last token is computed now)
        drafts, and never past its token limits."""
        if not self.num_lookahead_slots or num_new != 1:
            return 0
        if seq.num_computed_tokens + 1 != seq.num_tokens:
            return 0
        room = seq.max_num_tokens - seq.num_tokens - 1
        return max(0, min(self.num_lookahead_slots, room))

    def _unpark_one(self, out: SchedulerOutput, now: float) -> None:
        """When nothing could run this step but a sequence waits, its blocks (or batch slot)
        may be held by parked sequences (beams whose groups wait for beams that are queued):
        preempt one parked sequence, the policy's victim, and admit again. One per step, so a
        swapped head gets its chance (a swap-in never shares a step with a swap-out) before
        more are preempted; parked sequences are never admitted, so they cannot come straight
        back."""
        if not any(not s.parked for s in (*self.waiting, *self.swapped)):
            return
        parked = [s for s in self.running if s.parked]
        if not parked:
            return
        victim = self.serving.victim(parked, now)
        self.running.remove(victim)
        self._preempt(victim, out)
        self._admit(out, now)

    def _admit(self, out: SchedulerOutput, now: float) -> None:
        bm = self.block_manager
        admitted: set[int] = set()
        for seq in self.serving.order([*self.swapped, *self.waiting], now):
            if seq.parked:
                continue  # wants no slot until it is moved on
            is_swapped = seq.status == SequenceStatus.SWAPPED
            # prefix caching: a waiting sequence takes the cached blocks of its prefix first,
            # and gives them back when it is not admitted after all
            num_cached = 0 if is_swapped else bm.acquire_prefix(seq)
            if not self._admit_one(seq, is_swapped, admitted, out, now):
                if num_cached:
                    bm.release_prefix(seq)
                break  # NOTE: strict order: nobody overtakes the head of the queue
            self.num_prefix_cached_tokens += num_cached

    def _admit_one(
        self, seq: Sequence, is_swapped: bool, admitted: set[int], out: SchedulerOutput, now: float
    ) -> bool:
        """Admit one swapped or waiting sequence if it fits, making room when it outranks
        running ones; False when it does not (admission stops there)."""
        bm = self.block_manager
        num_new = self._num_new_tokens(seq)
        if num_new == 0:
            return False
        if is_swapped and out.swapped_out:
            # NOTE: swap-ins are copied before swap-outs; a device block freed by a
            # swap-out this step must not receive a swap-in in the same step
            return False
        num_tokens = seq.num_computed_tokens + num_new + self._lookahead(seq, num_new)

        def fits() -> bool:
            if len(self.running) >= self.max_batch_size:
                return False
            if is_swapped:
                return bm.can_swap_in(seq, num_tokens)
            return bm.can_allocate(seq, num_tokens)

        if not fits():
            if not self._make_room(seq, num_tokens, admitted, out, now):
                return False
            if is_swapped and out.swapped_out:
                return False  # NOTE: the same hazard: it comes back next step, in the room made
            if not fits():
                return False
        # NOTE: adapter residency is a resource like blocks, in the same strict order: a
        # hot adapter cannot starve a cold one by overtaking it
        if self.adapter_manager is not None and not self.adapter_manager.acquire(seq):
            return False
        if is_swapped:
            pairs = bm.swap_in(seq)
            out.blocks_to_swap_in.extend(pairs)
            out.swapped_in.append(seq)
            self.swapped.remove(seq)
            self.num_swap_ins += 1
        else:
            self.waiting.remove(seq)
        bm.allocate(seq, num_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        admitted.add(seq.seq_id)
        self._emit(seq, num_new, out)
        return True

    def _make_room(
        self, seq: Sequence, num_tokens: int, admitted: set[int], out: SchedulerOutput, now: float
    ) -> bool:
        """Preempt running sequences that `seq` outranks, worst first, if that makes room for
        it; otherwise preempt nobody. Returns whether anything was preempted."""
        bm = self.block_manager
        candidates = [
            r
            for r in self.running
            if r.seq_id not in admitted and self.serving.outranks(seq, r, now)
        ]
        if not candidates:
            return False
        order = self.serving.order(candidates, now)
        need_blocks = max(len(seq.host_block_table), -(-num_tokens // bm.block_size))
        need_blocks -= len(seq.block_table) + bm.num_free_blocks
        need_slots = len(self.running) + 1 - self.max_batch_size
        chosen: list[Sequence] = []
        while order and (need_blocks > 0 or need_slots > 0):
            victim = order.pop()
            chosen.append(victim)
            need_blocks -= bm.num_freeable_blocks(victim)
            need_slots -= 1
        if need_blocks > 0 or need_slots > 0:
            return False
        self.num_arrival_preemptions += len(chosen)
        for victim in chosen:
            self._unschedule(victim, out)
            self.running.remove(victim)
            self._preempt(victim, out)
        return True

    def _unschedule(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take `seq`'s share of this step back out of `out` (it is being preempted)."""
        for i, item in enumerate(out.scheduled):
            if item.seq is seq:
                del out.scheduled[i]
                out.num_batched_tokens -= item.num_new_tokens
                self.num_computed_prompt_tokens -= _num_prompt_tokens(
                    seq, item.start_pos, item.num_new_tokens
                )
                if item.num_new_tokens > 1:
                    out.num_prefill_tokens -= item.num_new_tokens
                    self.budget.spend(item.start_pos, item.num_new_tokens, -1)
                return

    def _emit(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        start = seq.num_computed_tokens
        needs_sample = start + num_new == seq.num_tokens
        lookahead = self._lookahead(seq, num_new)
        out.scheduled.append(ScheduledSequence(seq, start, num_new, needs_sample, lookahead))
        out.num_batched_tokens += num_new
        self.num_computed_prompt_tokens += _num_prompt_tokens(seq, start, num_new)
        if num_new > 1:
            out.num_prefill_tokens += num_new
            self.budget.spend(start, num_new)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt by swap when asked for and the host pool has room; else by recompute."""
        bm = self.block_manager
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.eviction_type == "swap" and bm.num_cached_blocks(seq) > 0 and bm.can_swap_out(seq):
            pairs = bm.swap_out(seq)
            out.blocks_to_swap_out.extend(pairs)
            out.swapped_out.append(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_swap_outs += 1
            self.num_swapped_blocks += len(pairs)
            return
        self._recompute(seq)
        out.preempted.append(seq)

    def _recompute(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV, requeue; the tokens are prefilled again."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.num_recomputes += 1

    # ---- requests from beam search ------------------------------------------------------------
    def requeue(self, seq: Sequence) -> None:
        """Send a live sequence back to the waiting queue to be recomputed from scratch."""
        self._dequeue(seq)
        self._recompute(seq)

    def park(self, seq: Sequence, parked: bool) -> None:
        """A parked sequence has nothing to compute until its owner moves it on: it is never
        admitted, and it is the first to give its blocks back when nothing else can run."""
        seq.parked = parked

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Extend a live sequence by one token chosen outside the sampler (a beam's)."""
        seq.token_ids.append(token_id)

    def fork(self, parent: Sequence, token_id: int, seq_id: int) -> Sequence:
        """A new sequence `seq_id` continuing `parent` with `token_id` (not yet computed).

        When the parent's KV is all on the device and a block is free, the child shares the
        parent's full blocks by reference and gets a copy of its partial last block (emitted
        in the next step's `blocks_to_copy`): it then only computes `token_id`. Otherwise it
        waits to be computed from scratch."""
        child = parent.fork(seq_id, token_id)
        self.num_forks += 1
        on_device = (
            parent.status == SequenceStatus.RUNNING
            and parent.num_computed_tokens == parent.num_tokens
        )
        adapters = self.adapter_manager
        if on_device and self.block_manager.can_fork(parent):
            if adapters is None or adapters.acquire(child):
                copy = self.block_manager.fork(parent, child)
                self.num_shared_blocks += len(child.block_table) - (copy is not None)
                if copy is not None:
                    self._pending_copies.append((*copy, child))
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                return child
        child.status = SequenceStatus.WAITING
        self.waiting.append(child)
        return child

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine ran `out` in `seconds`: the step cost model learns from it (steps that
        also moved blocks between pools cost what the model does not describe: skipped)."""
        if out.scheduled and not (out.blocks_to_swap_in or out.blocks_to_swap_out):
            self.budget.observe(out, seconds)

    def update(
        self,
        out: SchedulerOutput,
        new_tokens: dict[int, int | list[int]],
        finished: Iterable[Sequence] = (),
    ) -> None:
        """Take a step's results back: the computed chunks are now cached, sampled tokens
        (`seq_id -> token`) are appended, and `finished` sequences release their blocks.

        With speculative decoding a sequence may get a list of tokens: the accepted drafts
        and one token sampled after them. The drafts' KV was computed by the verifying
        forward, so all of them but the last token count as cached."""
        now = self.clock() if self.qos is not None else 0.0
        for item in out.scheduled:
            seq = item.seq
            if seq.status != SequenceStatus.RUNNING:
                continue  # removed during the step
            token = new_tokens.get(seq.seq_id)
            tokens = [token] if isinstance(token, int) else token or []
            seq.token_ids.extend(tokens)
            seq.num_computed_tokens = item.start_pos + item.num_new_tokens + max(0, len(tokens) - 1)
            self.block_manager.commit(seq)  # prefix caching: publish the now full blocks
            if self.qos is not None:
                mark = seq.num_tokens if tokens else seq.num_computed_tokens
                self.qos.charge(seq, mark, now)
        for seq in finished:
            self.remove_sequence(seq)

    # ---- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Queue lengths, free blocks of both pools, preemption counters; with QoS on, per-group
        queue lengths and served tokens under "qos" (see `QoS.stats`)."""
        bm = self.block_manager
        stats = {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_swapped": len(self.swapped),
            "num_free_blocks": bm.device.num_free,
            "num_total_blocks": bm.device.num_blocks,
            "num_free_cpu_blocks": bm.host.num_free,
            "num_total_cpu_blocks": bm.host.num_blocks,
            **{name: getattr(self, name) for name in _COUNTERS},
        }
        if bm.prefix_cache is not None:
            stats["num_prefix_cached_blocks"] = len(bm.prefix_cache)
            stats["num_evictable_blocks"] = len(bm.prefix_cache.evictable)
        if self.qos is not None:
            states = {"waiting": self.waiting, "running": self.running, "swapped": self.swapped}
            stats["qos"] = self.qos.stats(states, self.clock())
        if self.adapter_manager is not None:
            stats.update(self.adapter_manager.stats())
        return stats

    def check_integrity(self) -> None:
        """Assert both block pools agree with the live sequences' block tables, and that every
        sequence sits in the queue its status names."""
        for status, queue in (
            (SequenceStatus.WAITING, self.waiting),
            (SequenceStatus.RUNNING, self.running),
            (SequenceStatus.SWAPPED, self.swapped),
        ):
            for seq in queue:
                assert seq.status == status, f"seq {seq.seq_id} is {seq.status} in {status}"
        for seq in self.swapped:
            assert not seq.block_table, f"swapped seq {seq.seq_id} holds device blocks"
        for seq in self.waiting:
            assert not seq.host_block_table, f"waiting seq {seq.seq_id} holds host blocks"
        self.block_manager.check_integrity(self.live_sequences())
        if self.adapter_manager is not None:
            self.adapter_manager.check_integrity(self.live_sequences())


# the counters `stats` reports (attributes of the Scheduler, see __init__)
_COUNTERS = """num_preemptions num_recomputes num_swap_outs num_swap_ins num_swapped_blocks
num_arrival_preemptions num_computed_prompt_tokens num_prefix_cached_tokens num_forks
num_shared_blocks num_cow_copies""".split()


def _num_prompt_tokens(seq: Sequence, start: int, num_new: int) -> int:
    """How many of the tokens [start, start + num_new) of `seq` belong to its prompt."""
    return max(0, min(start + num_new, seq.num_prompt_tokens) - start)
