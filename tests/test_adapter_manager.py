"""AdapterManager and the scheduler's adapter admission, without torch: paging, LRU eviction,
reference counts, removal while busy, and no starvation of a cold adapter by a hot one."""

from __future__ import annotations

import random

import pytest

from lmengine.scheduler import AdapterManager, BlockManager, Scheduler, get_policy
from tests.test_scheduler import fake_step, make_seq


def _manager(pages=16):
    return AdapterManager({"qkv": pages, "o": pages})


def test_ranks_pack_without_waste_and_lru_evicts_idle_only():
    m = _manager(pages=16)
    ids = [m.register(f"a{i}", {"qkv": r, "o": r}) for i, r in enumerate((4, 4, 8))]
    seqs = [make_seq(i, 3, adapter_id=a) for i, a in enumerate(ids)]
    assert all(m.acquire(s) for s in seqs)  # 4 + 4 + 8 = 16 pages: all three fit exactly
    assert m.stats()["num_free_lora_pages"] == 0
    plan = m.plan(ids)
    assert [ld.adapter_id for ld in plan.loads] == ids
    assert sorted(p for ld in plan.loads for p in ld.pages["qkv"]) == list(range(16))
    big = m.register("big", {"qkv": 8})
    late = make_seq(9, 3, adapter_id=big)
    assert not m.acquire(late)  # all busy: nothing is evicted
    assert m.stats()["num_resident_adapters"] == 3
    m.release(seqs[0])
    assert not m.acquire(late)  # 4 idle pages are not enough: still nothing evicted
    assert m.stats()["num_resident_adapters"] == 3
    m.release(seqs[1])
    assert m.acquire(late)  # both rank-4 adapters (least recently used) make room
    assert m.stats()["num_adapter_evictions"] == 2
    m.check_integrity([seqs[2], late])
    m.release(seqs[2])
    m.release(late)
    m.release(late)  # idempotent
    assert m.stats()["num_active_adapters"] == 0
    m.check_integrity([])


def test_untargeted_kinds_take_no_pages():
    m = _manager(pages=8)
    a = m.register("attn-only", {"qkv": 8, "o": 0})
    b = m.register("o-only", {"o": 8})
    sa, sb = make_seq(0, 2, adapter_id=a), make_seq(1, 2, adapter_id=b)
    assert m.acquire(sa) and m.acquire(sb)  # different kinds: both resident at once
    assert m.plan([a, b]).page_tables == {a: {"qkv": list(range(8))}, b: {"o": list(range(8))}}


def test_register_errors():
    m = _manager(pages=8)
    m.register("a", {"qkv": 2})
    with pytest.raises(ValueError, match="already loaded"):
        m.register("a", {"qkv": 2})
    with pytest.raises(ValueError, match="needs 9 pages of qkv but the LoRA pool has 8"):
        m.register("huge", {"qkv": 9})
    with pytest.raises(ValueError, match="unknown adapter"):
        m.remove("nope")


def test_removed_adapter_finishes_its_sequences_then_frees_its_pages():
    m = _manager()
    a = m.register("a", {"qkv": 4})
    s = make_seq(0, 2, adapter_id=a)
    assert m.acquire(s)
    m.plan([a])
    assert m.remove("a") == a
    assert m.id_of("a") is None and m.plan([a]).page_tables[a]  # still usable while running
    m.release(s)
    plan = m.plan([])
    assert plan.drops == [a] and a not in m.adapters
    assert m.stats()["num_free_lora_pages"] == 32
    m.check_integrity([])
    again = m.register("a", {"qkv": 4})  # the name can come back, under a new id
    assert again != a


def _lora_scheduler(capacity, max_batch=8):
    manager = AdapterManager({"qkv": capacity})
    sched = Scheduler(
        BlockManager(256, 0, 4),
        get_policy("fcfs"),
        max_batch,
        256,
        clock=lambda: 0.0,
        adapter_manager=manager,
    )
    return sched, manager


def test_hot_adapter_does_not_starve_a_cold_one():
    """The pool holds one adapter. A hot adapter gets a new request every step; a cold one
    arrives once. The cold request must run after the hot requests queued before it, and
    before those queued after it."""
    sched, m = _lora_scheduler(capacity=8)
    hot, cold = m.register("hot", {"qkv": 8}), m.register("cold", {"qkv": 8})
    seq_id = 0
    cold_seq, cold_arrival_step, first_cold_step, hot_after_cold = None, None, None, []
    for step in range(60):
        seq = make_seq(seq_id, 3, max_new=4, adapter_id=hot, arrival=step)
        sched.add_sequence(seq)
        if cold_seq is not None and first_cold_step is None:
            hot_after_cold.append(seq)
        seq_id += 1
        if step == 3:
            cold_seq = make_seq(seq_id, 3, max_new=4, adapter_id=cold, arrival=step + 0.5)
            sched.add_sequence(cold_seq)
            cold_arrival_step = step
            seq_id += 1
        out = fake_step(sched, finish_after=4)
        if first_cold_step is None and any(it.seq is cold_seq for it in out.scheduled):
            first_cold_step = step
            assert all(s.num_computed_tokens == 0 for s in hot_after_cold)
    assert first_cold_step is not None, "the cold adapter's request starved"
    assert first_cold_step - cold_arrival_step <= 6  # the hot requests ahead of it drain
    assert cold_seq.is_finished
    assert m.stats()["num_adapter_loads"] >= 3  # hot, cold, hot again


def test_random_mix_keeps_pages_and_references_consistent():
    rng = random.Random(0)
    sched, m = _lora_scheduler(capacity=12, max_batch=6)
    ids = [m.register(f"a{i}", {"qkv": rng.choice([2, 4, 8])}) for i in range(7)]
    live = []
    for step in range(200):
        if rng.random() < 0.6:
            adapter = rng.choice([*ids, None])
            seq = make_seq(step, rng.randint(1, 9), max_new=rng.randint(1, 6), adapter_id=adapter)
            sched.add_sequence(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sched.remove_sequence(victim)
        fake_step(sched, finish_after=rng.randint(1, 6))
        live = [s for s in live if not s.is_finished]
    while sched.has_unfinished:
        fake_step(sched, finish_after=1)
    sched.check_integrity()
    stats = m.stats()
    assert stats["num_active_adapters"] == 0 and stats["num_adapter_evictions"] > 0
