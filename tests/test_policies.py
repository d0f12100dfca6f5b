"""Scheduling policies without torch: serving order, victims, preemption by a higher priority,
aging against starvation, completion order with max_batch_size=1, user-registered policies."""

from __future__ import annotations

import random

import pytest

from lmengine.scheduler import Policy, SequenceStatus, get_policy, register_policy
from tests.test_scheduler_swap import Clock, drive, make_scheduler, make_seq


def ids(seqs):
    return [s.seq_id for s in seqs]


def policy_case():
    """Five sequences: (seq_id, prompt_len, max_new, priority), arriving in id order."""
    spec = [(0, 5, 9, 1), (1, 12, 3, None), (2, 2, 6, 4), (3, 7, 3, 1), (4, 9, 12, None)]
    return [make_seq(i, n, max_new=m, priority=p) for i, n, m, p in spec]


EXPECTED_ORDER = {
    "fcfs": [0, 1, 2, 3, 4],
    "lcfs": [4, 3, 2, 1, 0],
    "priority": [2, 0, 3, 1, 4],  # larger first, None last, ties by arrival
    "sjf": [1, 3, 2, 0, 4],  # max_new 3, 3, 6, 9, 12; ties by arrival
    "ldf": [1, 4, 3, 0, 2],  # prompt lengths 12, 9, 7, 5, 2
    "srpf": [2, 0, 3, 4, 1],  # prompt tokens left 2, 5, 7, 9, 12
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ORDER))
def test_policy_order_and_victim(name):
    policy = get_policy(name)
    seqs = policy_case()
    random.Random(0).shuffle(seqs)
    assert ids(policy.order(seqs, now=10.0)) == EXPECTED_ORDER[name]
    assert policy.victim(seqs, now=10.0).seq_id == EXPECTED_ORDER[name][-1]


@pytest.mark.parametrize("name", sorted(EXPECTED_ORDER))
def test_completion_order_with_batch_size_one(name):
    s = make_scheduler(max_batch=1, policy=name, eviction="recompute")
    seqs = policy_case()
    for q in seqs:
        s.add_sequence(q)
    finished, _ = drive(s, [], {q.seq_id: q.max_new_tokens for q in seqs})
    assert finished == EXPECTED_ORDER[name]


def test_priority_arrival_preempts_a_lower_running_sequence_when_there_is_no_room():
    s = make_scheduler(max_batch=1, policy="priority", num_cpu_blocks=16)
    low = make_seq(0, 6, max_new=20, priority=1)
    s.add_sequence(low)
    for _ in range(3):
        out = s.schedule()
        s.update(out, {low.seq_id: 9})
    high = make_seq(1, 4, max_new=5, priority=7)
    s.add_sequence(high)
    out = s.schedule()
    assert ids(it.seq for it in out.scheduled) == [1]
    assert out.swapped_out == [low] and low.status == SequenceStatus.SWAPPED
    assert s.stats()["num_arrival_preemptions"] == 1
    s.check_integrity()


@pytest.mark.parametrize("name,prio", [("priority", 1), ("fcfs", 7), ("sjf", 7)])
def test_no_preemption_without_strictly_higher_priority(name, prio):
    s = make_scheduler(max_batch=1, policy=name, num_cpu_blocks=16)
    first = make_seq(0, 6, max_new=20, priority=1)
    s.add_sequence(first)
    out = s.schedule()
    s.update(out, {0: 9})
    s.add_sequence(make_seq(1, 4, max_new=2, priority=prio))
    out = s.schedule()
    assert ids(it.seq for it in out.scheduled) == [0] and not out.swapped_out


def test_priority_preemption_frees_enough_blocks_or_preempts_nobody():
    # 8 blocks of 4: two low-priority sequences hold 3 blocks each
    s = make_scheduler(num_blocks=8, max_batch=4, policy="priority", num_cpu_blocks=16)
    lows = [make_seq(i, 11, max_new=30, priority=0) for i in range(2)]
    for q in lows:
        s.add_sequence(q)
    out = s.schedule()
    s.update(out, {q.seq_id: 9 for q in lows})
    mid = make_seq(5, 20, max_new=4, priority=0)  # same priority: may not preempt
    s.add_sequence(mid)
    out = s.schedule()
    assert not out.swapped_out and mid.status == SequenceStatus.WAITING
    s.remove_sequence(mid)
    huge = make_seq(7, 36, max_new=4, priority=3)  # 9 blocks: even preempting both is short
    s.add_sequence(huge)
    out = s.schedule()
    assert not out.swapped_out and not out.preempted and huge.status == SequenceStatus.WAITING
    s.remove_sequence(huge)
    high = make_seq(6, 24, max_new=4, priority=3)  # 6 blocks: 2 free + 3 + 3 from both lows
    s.add_sequence(high)
    out = s.schedule()
    assert sorted(ids(out.swapped_out)) == [0, 1] and high.status == SequenceStatus.RUNNING
    s.check_integrity()


def test_priority_none_runs_last_and_aging_counts_it_as_zero():
    plain, aged = get_policy("priority"), get_policy("priority", priority_aging_s=5.0)
    a = make_seq(0, 3, priority=None, arrival=0.0)
    b = make_seq(1, 3, priority=-3, arrival=9.0)
    assert ids(plain.order([a, b], now=10.0)) == [1, 0]
    # aged: a is at 0 + 2 levels, b at -3 + 0 levels
    assert ids(aged.order([a, b], now=10.0)) == [0, 1]


def test_aging_raises_effective_priority_with_waiting_time():
    p = get_policy("priority", priority_aging_s=2.0)
    old = make_seq(0, 3, priority=0, arrival=0.0)
    new = make_seq(1, 3, priority=3, arrival=10.0)
    assert ids(p.order([old, new], now=10.0)) == [0, 1]  # 0 + 5 levels > 3 + 0
    assert ids(p.order([old, new], now=5.0)) == [1, 0]  # 0 + 2 levels < 3
    fcfs_aged = get_policy("sjf", priority_aging_s=2.0)
    long = make_seq(2, 3, max_new=50, arrival=0.0)
    short = make_seq(3, 3, max_new=2, arrival=9.0)
    assert ids(fcfs_aged.order([long, short], now=9.5)) == [2, 3]
    with pytest.raises(ValueError, match="priority_aging_s"):
        get_policy("priority", priority_aging_s=-1)


def _starvation_run(policy, aging_s, low_kw, high_kw, steps=400):
    """A low-ranked request at t=0 under a stream of favoured requests, one every 2 steps
    (each needs 3): returns the step at which the low one finished, or None."""
    s = make_scheduler(
        max_batch=1, policy=policy, num_cpu_blocks=32, priority_aging_s=aging_s, clock=Clock()
    )
    low = make_seq(0, 4, arrival=0.0, **low_kw)
    s.add_sequence(low)
    limits = {0: low.max_new_tokens}
    for step in range(steps):
        if step % 2 == 0:
            q = make_seq(step + 1, 4, arrival=s.clock.t, **high_kw)
            limits[q.seq_id] = q.max_new_tokens
            s.add_sequence(q)
        out = s.schedule()
        new = {it.seq.seq_id: 3 for it in out.scheduled if it.needs_sample}
        done = [
            it.seq
            for it in out.scheduled
            if it.needs_sample and it.seq.num_generated_tokens + 1 >= limits[it.seq.seq_id]
        ]
        s.update(out, new, done)
        s.check_integrity()
        if low in done:
            return step
        s.clock.t += 1.0
    return None


@pytest.mark.parametrize(
    "policy,low_kw,high_kw",
    [
        ("priority", dict(priority=0, max_new=3), dict(priority=5, max_new=3)),
        ("sjf", dict(max_new=6), dict(max_new=3)),
    ],
)
def test_aging_prevents_starvation_under_a_stream_of_favoured_work(policy, low_kw, high_kw):
    assert _starvation_run(policy, 0.0, low_kw, high_kw) is None, "control: it starves"
    finished_at = _starvation_run(policy, 10.0, low_kw, high_kw)
    assert finished_at is not None and finished_at < 250


def test_registered_custom_policy_drives_the_scheduler():
    @register_policy("test_short_prompt_first")
    class ShortPromptFirst(Policy):
        def key(self, seq, now):
            return (seq.num_prompt_tokens, seq.arrival_time, seq.seq_id)

    s = make_scheduler(max_batch=1, policy="test_short_prompt_first")
    seqs = policy_case()
    for q in seqs:
        s.add_sequence(q)
    finished, _ = drive(s, [], {q.seq_id: 2 for q in seqs})
    assert finished == [2, 0, 3, 4, 1]  # prompt lengths 2, 5, 7, 9, 12
    with pytest.raises(TypeError):
        register_policy("not_a_policy")(object)


def _first_tokens(policy: str, aging_s: float = 0.0) -> list[int]:
    """A burst of prompts of 900, 50, 400 and 30 tokens arriving in that order, then from
    step 5 a 64-token prompt every step (the whole budget: 64 prompt tokens a step): the
    order of the burst's first tokens."""
    s = make_scheduler(num_blocks=512, budget=64, policy=policy, eviction="recompute",
                       clock=Clock(), priority_aging_s=aging_s)  # fmt: skip
    for i, n in enumerate((900, 50, 400, 30)):
        s.add_sequence(make_seq(i, n, max_new=2, arrival=0.0))
    order: list[int] = []
    for step in range(200):
        if step >= 5:
            s.add_sequence(make_seq(10 + step, 64, max_new=1, arrival=s.clock.t))
        out = s.schedule()
        new = {it.seq.seq_id: 3 for it in out.scheduled if it.needs_sample}
        order += [i for i in new if i < 4 and i not in order]
        s.update(out, new, [it.seq for it in out.scheduled if it.needs_sample])
        s.clock.t += 0.1
    return order


def test_srpf_gives_a_burst_its_first_tokens_shortest_first_and_aging_bounds_the_wait():
    assert _first_tokens("fcfs") == [0, 1, 2, 3]
    assert _first_tokens("srpf")[:2] == [3, 1]  # 30 and 50 tokens: in the first steps
    # a stream of short prompts keeps overtaking the long ones, until they age
    assert 0 not in _first_tokens("srpf")
    assert _first_tokens("srpf", aging_s=1.0) == [3, 1, 2, 0]
