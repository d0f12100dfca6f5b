"""Preemption by swap in the Scheduler, without torch: a pure-Python fake KV cache follows every
copy a SchedulerOutput lists and checks that each sequence always reads its own tokens back."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from lmengine.scheduler import BlockManager, Scheduler, Sequence, SequenceStatus, get_policy


class Clock:
    """A settable clock for the scheduler (seconds)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_seq(seq_id, prompt_len, max_new=8, arrival=None, **kw):
    cfg = SimpleNamespace(max_new_tokens=max_new)
    prompt = [100 * seq_id + i for i in range(1, prompt_len + 1)]
    seq = Sequence(seq_id, seq_id, prompt, cfg, **kw)
    seq.arrival_time = float(seq_id if arrival is None else arrival)
    return seq


def make_scheduler(
    num_blocks=64,
    num_cpu_blocks=0,
    block_size=4,
    max_batch=8,
    budget=64,
    policy="fcfs",
    eviction="swap",
    clock=None,
    qos=None,
    **policy_kw,
):
    bm = BlockManager(num_blocks, num_cpu_blocks, block_size)
    return Scheduler(
        bm,
        get_policy(policy, **policy_kw),
        max_batch,
        budget,
        clock=clock or Clock(),
        eviction_type=eviction,
        qos=qos,
    )


class FakeCache:
    """Device and host pools of token slots. Applies a step's copies in the ModelAgent's order
    (swap in, swap out, copy), checks every scheduled sequence's cached tokens, then writes."""

    def __init__(self, bm: BlockManager) -> None:
        self.bs = bm.block_size
        self.device = [[None] * self.bs for _ in range(bm.device.num_blocks)]
        self.host = [[None] * self.bs for _ in range(bm.host.num_blocks)]

    def run(self, out) -> None:
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        for s, d in out.blocks_to_copy:
            self.device[d] = list(self.device[s])
        for it in out.scheduled:
            table, toks = it.block_table, it.seq.token_ids
            cached = [self.device[table[p // self.bs]][p % self.bs] for p in range(it.start_pos)]
            assert cached == toks[: it.start_pos], f"seq {it.seq.seq_id} lost its KV"
        for it in out.scheduled:
            for p in range(it.start_pos, it.start_pos + it.num_new_tokens):
                self.device[it.block_table[p // self.bs]][p % self.bs] = it.seq.token_ids[p]


def drive(sched, pending, limits, rng=None, steps=5000, add_prob=0.3, abort_prob=0.0, tick=1.0):
    """Run the scheduler with a fake model until every sequence is done; returns
    (finish order, list of SchedulerOutputs)."""
    cache = FakeCache(sched.block_manager)
    rng = rng or random.Random(0)
    finished_order, outs = [], []
    for _ in range(steps):
        if pending and rng.random() < add_prob:
            sched.add_sequence(pending.pop(0))
        if abort_prob and sched.has_unfinished and rng.random() < abort_prob:
            victim = rng.choice(list(sched.live_sequences()))
            sched.remove_sequence(victim)
            finished_order.append(victim.seq_id)
        out = sched.schedule()
        cache.run(out)
        new = {it.seq.seq_id: 1000 + it.seq.num_tokens for it in out.scheduled if it.needs_sample}
        done = [
            it.seq
            for it in out.scheduled
            if it.needs_sample and it.seq.num_generated_tokens + 1 >= limits[it.seq.seq_id]
        ]
        sched.update(out, new, done)
        finished_order += [s.seq_id for s in done]
        outs.append(out)
        sched.check_integrity()
        sched.clock.t += tick
        if not pending and not sched.has_unfinished:
            break
    return finished_order, outs


def test_swap_out_moves_the_victims_cached_blocks_and_resumes_it():
    # 6 device blocks of 4: two sequences of 8 tokens (2 blocks each) grow until one is evicted
    s = make_scheduler(num_blocks=6, num_cpu_blocks=8)
    a, b = make_seq(0, 8, max_new=20), make_seq(1, 8, max_new=20)
    s.add_sequence(a)
    s.add_sequence(b)
    cache = FakeCache(s.block_manager)
    swap_out_step = None
    for step in range(40):
        before = list(b.block_table)
        out = s.schedule()
        cache.run(out)
        if out.swapped_out and swap_out_step is None:
            swap_out_step = step
            assert out.swapped_out == [b], "the later arrival is the FCFS victim"
            assert [d for d, _ in out.blocks_to_swap_out] == before[: len(b.host_block_table)]
            assert b.status == SequenceStatus.SWAPPED and not b.block_table
            assert not out.preempted, "the host had room: no recompute"
            computed = b.num_computed_tokens
        if swap_out_step is not None and out.swapped_in:
            assert out.swapped_in == [b] and b.num_computed_tokens == computed
            assert [it.num_new_tokens for it in out.scheduled if it.seq is b] == [1]
            break
        s.update(out, {it.seq.seq_id: 5 for it in out.scheduled if it.needs_sample})
        s.check_integrity()
        if a.num_generated_tokens >= 12:
            s.remove_sequence(a)  # a finishes: room for b to come back
    else:
        pytest.fail("b was never swapped out and back in")
    assert s.num_recomputes == 0 and s.num_swap_outs == 1 and s.num_swap_ins == 1


def test_full_host_pool_falls_back_to_recompute():
    s = make_scheduler(num_blocks=6, num_cpu_blocks=1)  # b needs 2-3 host blocks: no room
    a, b = make_seq(0, 8, max_new=20), make_seq(1, 8, max_new=20)
    s.add_sequence(a)
    s.add_sequence(b)
    finished, _ = drive(s, [], {0: 12, 1: 12})  # 8 + 12 tokens: 5 blocks, one fits alone
    assert s.num_recomputes > 0 and s.num_swap_outs == 0
    assert sorted(finished) == [0, 1]


def test_abort_of_a_swapped_sequence_frees_its_host_blocks():
    s = make_scheduler(num_blocks=6, num_cpu_blocks=8)
    a, b = make_seq(0, 8, max_new=20), make_seq(1, 8, max_new=20)
    s.add_sequence(a)
    s.add_sequence(b)
    while b.status != SequenceStatus.SWAPPED:
        out = s.schedule()
        s.update(out, {it.seq.seq_id: 5 for it in out.scheduled if it.needs_sample})
    assert s.block_manager.host.num_free < 8
    s.remove_sequence(b)
    s.check_integrity()
    assert s.block_manager.host.num_free == 8 and not s.swapped


def test_no_swap_in_in_a_step_that_swaps_out():
    rng = random.Random(3)
    s = make_scheduler(num_blocks=10, num_cpu_blocks=12, block_size=2, budget=8)
    pending = [make_seq(i, rng.randint(1, 8)) for i in range(12)]
    limits = {q.seq_id: rng.randint(4, 10) for q in pending}
    _, outs = drive(s, pending, limits, rng)
    assert sum(bool(o.swapped_out) for o in outs) > 3
    for o in outs:
        assert not (o.blocks_to_swap_in and o.blocks_to_swap_out)


@pytest.mark.parametrize("seed", range(24))
def test_random_workload_with_swap_keeps_kv_and_integrity(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = 30 // block_size + rng.randint(1, 6)
    s = make_scheduler(
        num_blocks,
        num_cpu_blocks=rng.randint(0, 12),
        block_size=block_size,
        budget=rng.randint(1, 24),
        max_batch=rng.randint(1, 8),
        policy=rng.choice(["fcfs", "lcfs", "priority", "sjf", "ldf"]),
    )
    pending = [
        make_seq(i, rng.randint(1, 20), max_new=rng.randint(1, 10), priority=rng.randint(0, 3))
        for i in range(20)
    ]
    limits = {q.seq_id: q.max_new_tokens for q in pending}
    finished, _ = drive(s, pending, limits, rng, abort_prob=0.02)
    assert sorted(finished) == list(range(20)) and not s.has_unfinished
    bm = s.block_manager
    assert bm.device.num_free == num_blocks and bm.host.num_free == bm.host.num_blocks


def test_many_swaps_and_recomputes_happen_in_one_workload():
    rng = random.Random(7)
    s = make_scheduler(num_blocks=12, num_cpu_blocks=6, block_size=2, budget=16)
    pending = [make_seq(i, rng.randint(2, 10), max_new=12) for i in range(16)]
    finished, _ = drive(s, pending, {q.seq_id: 12 for q in pending}, rng, add_prob=0.6)
    assert sorted(finished) == list(range(16))
    assert s.num_swap_outs >= 5 and s.num_recomputes >= 5, s.stats()
    assert s.num_swap_ins == s.num_swap_outs


def test_swapped_head_that_preempts_waits_a_step_before_swapping_in():
    # batch 1: a runs; b (higher priority) arrives and swaps a out. Then a's effective priority
    # overtakes b's (as aging can do): a preempts b, but may only swap in the next step
    s = make_scheduler(max_batch=1, policy="priority", num_cpu_blocks=16)
    cache = FakeCache(s.block_manager)
    a, b = make_seq(0, 6, max_new=20, priority=1), make_seq(1, 5, max_new=20, priority=3)

    def step():
        out = s.schedule()
        cache.run(out)
        s.update(out, {it.seq.seq_id: 50 + it.seq.num_tokens for it in out.scheduled})
        s.check_integrity()
        assert not (out.blocks_to_swap_in and out.blocks_to_swap_out)
        return out

    s.add_sequence(a)
    step()
    step()
    s.add_sequence(b)
    assert step().swapped_out == [a]
    step()
    a.priority = 7
    out = step()
    assert out.swapped_out == [b] and not out.swapped_in and not out.scheduled
    out = step()
    assert out.swapped_in == [a] and [it.seq for it in out.scheduled] == [a]
    for _ in range(3):
        step()  # the fake cache checks that a and b read their own tokens
