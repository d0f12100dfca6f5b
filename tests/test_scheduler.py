"""Scheduler and BlockManager without torch: fake model outputs, assertions on SchedulerOutput."""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest

from lmengine.scheduler import BlockManager, Scheduler, Sequence, SequenceStatus, get_policy


def make_seq(seq_id, prompt_len, max_new=8, arrival=None, **kw):
    cfg = SimpleNamespace(max_new_tokens=max_new)
    seq = Sequence(seq_id, seq_id, list(range(1, prompt_len + 1)), cfg, **kw)
    if arrival is not None:
        seq.arrival_time = arrival
    return seq


def make_scheduler(num_blocks=64, block_size=4, max_batch=8, budget=64, policy="fcfs"):
    bm = BlockManager(num_blocks, 0, block_size)
    return Scheduler(bm, get_policy(policy), max_batch, budget, clock=lambda: 0.0)


def fake_step(sched, token=7, finish_after=None):
    """One step with a fake model: every sampling sequence gets `token`."""
    out = sched.schedule()
    new = {it.seq.seq_id: token for it in out.scheduled if it.needs_sample}
    finished = []
    if finish_after is not None:
        finished = [
            it.seq
            for it in out.scheduled
            if it.needs_sample and it.seq.num_generated_tokens + 1 >= finish_after
        ]
    sched.update(out, new, finished)
    sched.check_integrity()
    return out


def test_scheduler_imports_no_torch():
    import subprocess

    code = "import sys, lmengine.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_prefill_then_decode_mixed_in_one_step():
    s = make_scheduler()
    a = make_seq(0, 10)
    s.add_sequence(a)
    out = fake_step(s)
    assert [(it.start_pos, it.num_new_tokens, it.needs_sample) for it in out.scheduled] == [
        (0, 10, True)
    ]
    b = make_seq(1, 5)
    s.add_sequence(b)
    out = fake_step(s)
    # the decode of a and the prefill of b run together
    assert [(it.seq.seq_id, it.start_pos, it.num_new_tokens) for it in out.scheduled] == [
        (0, 10, 1),
        (1, 0, 5),
    ]
    assert out.num_prefill_tokens == 5 and out.num_batched_tokens == 6


def test_long_prompt_is_chunked_within_budget():
    s = make_scheduler(budget=4)
    a = make_seq(0, 10)
    s.add_sequence(a)
    chunks = []
    for _ in range(3):
        out = fake_step(s)
        it = out.scheduled[0]
        chunks.append((it.start_pos, it.num_new_tokens, it.needs_sample))
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert a.num_tokens == 11 and a.num_computed_tokens == 10


@pytest.mark.parametrize(
    "second, expected",
    [
        (8, [(0, 10), (1, 8)]),  # 2 over the 6 left: within the slack of 16 / 8, finished now
        (9, [(0, 10), (1, 6)]),  # 3 over: a chunk of the 6 left, the tail waits a step
        (30, [(0, 10), (1, 6)]),
    ],
)
def test_a_prompt_finishes_in_the_step_when_it_overruns_the_budget_by_little(second, expected):
    s = make_scheduler(num_blocks=64, budget=16)
    s.add_sequence(make_seq(0, 10, arrival=0))
    s.add_sequence(make_seq(1, second, arrival=1))
    s.add_sequence(make_seq(2, 5, arrival=2))  # no budget left for it either way
    out = fake_step(s)
    assert [(it.seq.seq_id, it.num_new_tokens) for it in out.scheduled] == expected
    assert out.num_prefill_tokens == sum(n for _, n in expected)


def test_max_batch_size_limits_running():
    s = make_scheduler(max_batch=2)
    for i in range(4):
        s.add_sequence(make_seq(i, 3, arrival=i))
    out = fake_step(s)
    assert [it.seq.seq_id for it in out.scheduled] == [0, 1]
    assert len(s.waiting) == 2


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens: two sequences of 8 tokens fill 4 blocks; growth forces preemption
    s = make_scheduler(num_blocks=6, block_size=4)
    a, b = make_seq(0, 8, max_new=20, arrival=0), make_seq(1, 8, max_new=20, arrival=1)
    s.add_sequence(a)
    s.add_sequence(b)
    preempted = []
    for _ in range(10):
        out = fake_step(s)
        preempted += out.preempted
    assert b in preempted, "the later arrival is the FCFS victim"
    assert a.num_preemptions == 0
    assert b.num_computed_tokens == 0 or b.status == SequenceStatus.RUNNING


def test_abort_frees_blocks_everywhere():
    s = make_scheduler(num_blocks=16)
    seqs = [make_seq(i, 6) for i in range(3)]
    for q in seqs:
        s.add_sequence(q)
    fake_step(s)
    for q in seqs:
        s.remove_sequence(q)
    s.check_integrity()
    assert s.block_manager.num_free_blocks == 16 and not s.has_unfinished


def test_remove_sequence_frees_it_and_is_idempotent():
    s = make_scheduler()
    q = make_seq(5, 4)
    s.add_sequence(q)
    fake_step(s)
    s.remove_sequence(q)
    s.remove_sequence(q)
    assert q.status == SequenceStatus.FINISHED and s.block_manager.num_free_blocks == 64
    assert not s.has_unfinished
    s.check_integrity()


def test_policy_registry_rejects_unknown_name():
    with pytest.raises(ValueError, match="fcfs"):
        get_policy("nope")


def test_block_pool_double_free_is_caught():
    bm = BlockManager(4, 0, 2)
    q = make_seq(0, 3)
    bm.allocate(q, 3)
    table = list(q.block_table)
    bm.free(q)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.device.free(table)


def test_block_pool_reuses_the_last_freed_blocks_first():
    """The most recently freed blocks are the ones most likely still in the CPU's caches."""
    bm = BlockManager(8, 0, 2)
    a, b = make_seq(0, 4), make_seq(1, 4)
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    freed_last = list(b.block_table)
    bm.free(a)
    bm.free(b)
    c = make_seq(2, 4)
    bm.allocate(c, 4)
    assert sorted(c.block_table) == sorted(freed_last)


@pytest.mark.parametrize("seed", range(16))
def test_random_workload_keeps_integrity_and_finishes(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    # the longest sequence (20 + 10 tokens) must fit the pool alone, as the engine guarantees
    num_blocks = 32 // block_size + rng.randint(1, 8)
    s = make_scheduler(num_blocks, block_size, budget=rng.randint(1, 32))
    pending = [make_seq(i, rng.randint(1, 20), arrival=i) for i in range(20)]
    limits = {q.seq_id: rng.randint(1, 10) for q in pending}
    done = set()
    for _step in range(2000):
        if pending and rng.random() < 0.3:
            s.add_sequence(pending.pop(0))
        if rng.random() < 0.05 and s.running:
            victim = rng.choice(s.running)
            s.remove_sequence(victim)
            done.add(victim.seq_id)
        out = s.schedule()
        new = {it.seq.seq_id: 1 for it in out.scheduled if it.needs_sample}
        finished = [
            it.seq
            for it in out.scheduled
            if it.needs_sample and it.seq.num_generated_tokens + 1 >= limits[it.seq.seq_id]
        ]
        s.update(out, new, finished)
        done.update(q.seq_id for q in finished)
        s.check_integrity()
        if not pending and not s.has_unfinished:
            break
    assert not s.has_unfinished and len(done) == 20
    assert s.block_manager.num_free_blocks == num_blocks


def _park(sched, seqs):
    """Run `seqs` to a computed state with nothing left to compute, as beams whose row is in
    wait for their group (the engine's BeamSearch parks them)."""
    for seq in seqs:
        sched.add_sequence(seq)
    out = sched.schedule()
    assert {it.seq.seq_id for it in out.scheduled} == {s.seq_id for s in seqs}
    sched.update(out, {}, [])  # computed; no token appended: a beam waits for its round
    for seq in seqs:
        seq.parked = True
        assert seq.num_computed_tokens == seq.num_tokens


@pytest.mark.parametrize("eviction", ["recompute", "swap"])
def test_parked_sequences_give_their_blocks_when_nothing_else_can_run(eviction):
    """The beam-search stall: parked beams hold the pool, the beams their groups wait for
    queue behind. Each stalled step preempts one parked sequence until the head fits;
    parked sequences are never admitted back, and they do not block the queue."""
    bm = BlockManager(8, 16 if eviction == "swap" else 0, 4)
    s = Scheduler(bm, get_policy("fcfs"), 8, 64, clock=lambda: 0.0, eviction_type=eviction)
    a, b, c = make_seq(0, 8, arrival=0.0), make_seq(1, 8, arrival=1.0), make_seq(2, 8, arrival=2.0)
    _park(s, [a, b])  # 4 of 8 blocks
    _park(s, [c])  # 6 of 8
    waiting = make_seq(3, 12, arrival=3.0)  # needs 3 blocks: 2 free
    s.add_sequence(waiting)
    out = s.schedule()  # stall: the newest parked one (fcfs victim) makes room
    assert [it.seq for it in out.scheduled] == [waiting]
    assert c.status != SequenceStatus.RUNNING and (out.preempted or out.swapped_out) == [c]
    assert a.status == b.status == SequenceStatus.RUNNING
    s.update(out, {3: 5}, [])
    s.check_integrity()
    # c stays out while parked, even with room for it, and does not block d behind it
    d = make_seq(4, 2, arrival=4.0)
    s.add_sequence(d)
    s.remove_sequence(a)
    out = s.schedule()
    assert {it.seq.seq_id for it in out.scheduled} == {3, 4}
    assert c.status != SequenceStatus.RUNNING
    s.update(out, {3: 5, 4: 5}, [waiting, d])  # both finish
    # its group moves on (the engine clears the flag): admitted like any other
    c.parked = False
    c.token_ids.append(9)
    out = s.schedule()
    assert 2 in {it.seq.seq_id for it in out.scheduled}
    s.update(out, {it.seq.seq_id: 5 for it in out.scheduled if it.needs_sample}, [])
    s.check_integrity()


def test_no_unparking_while_something_runs_or_nothing_waits():
    s = make_scheduler(num_blocks=8)
    a = make_seq(0, 8)
    _park(s, [a])
    out = s.schedule()  # nothing waits: a keeps its blocks
    assert not out.scheduled and not out.preempted and a.status == SequenceStatus.RUNNING
    parked_waiting = make_seq(1, 20)
    parked_waiting.parked = True
    s.add_sequence(parked_waiting)
    out = s.schedule()  # only a parked one waits: nobody is preempted for it
    assert not out.preempted and a.status == SequenceStatus.RUNNING
