"""Prefix caching in the BlockManager and Scheduler, without torch: content-addressed blocks,
reference counts, LRU eviction, integrity, and a simulated KV cache that checks every read."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from lmengine.scheduler import BlockManager, Scheduler, Sequence, get_policy

BS = 4


def make_seq(seq_id, tokens, max_new=4, adapter=None, adapter_id=None):
    cfg = SimpleNamespace(max_new_tokens=max_new)
    return Sequence(seq_id, seq_id, list(tokens), cfg, adapter_name=adapter, adapter_id=adapter_id)


def run_prefill(bm, seq):
    """Admit `seq` by hand: cached prefix, blocks for the rest, all of it computed."""
    cached = bm.acquire_prefix(seq)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return cached


def test_full_blocks_are_reused_and_reference_counted():
    bm = BlockManager(16, 0, BS, enable_prefix_caching=True)
    a = make_seq(0, range(1, 11))  # 10 tokens: 2 full blocks + 2 tokens
    assert run_prefill(bm, a) == 0
    a_table = list(a.block_table)
    assert len(bm.prefix_cache) == 2  # the partial block is not cached
    bm.check_integrity([a])

    b = make_seq(1, [*range(1, 9), 99, 98, 97])  # shares the first 8 tokens
    c = make_seq(2, [*range(1, 9), 50])
    assert run_prefill(bm, b) == 8 and run_prefill(bm, c) == 8
    assert b.block_table[:2] == c.block_table[:2] == a_table[:2]
    assert [bm.device.ref_counts[i] for i in a_table[:2]] == [3, 3]
    bm.check_integrity([a, b, c])

    for s in (a, b, c):
        bm.free(s)
    # every block is free again, the two shared ones as evictable cache entries
    assert bm.num_free_blocks == 16 and len(bm.prefix_cache.evictable) >= 2
    bm.check_integrity([])
    d = make_seq(3, range(1, 11))
    assert run_prefill(bm, d) == 8 and d.block_table[:2] == a_table[:2]
    bm.check_integrity([d])


def test_a_block_that_differs_in_a_token_or_adapter_is_not_reused():
    bm = BlockManager(16, 0, BS, enable_prefix_caching=True)
    run_prefill(bm, make_seq(0, range(1, 13)))
    assert run_prefill(bm, make_seq(1, [1, 2, 3, 4, 5, 6, 0, 8, 9, 10])) == 4  # block 1 differs
    assert run_prefill(bm, make_seq(2, range(1, 13), adapter="sql")) == 0
    assert run_prefill(bm, make_seq(3, range(1, 13), adapter="sql")) == 8
    assert run_prefill(bm, make_seq(4, range(1, 13), adapter="chat")) == 0


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(16, 0, BS, enable_prefix_caching=True)
    run_prefill(bm, make_seq(0, range(1, 9)))  # exactly 2 full blocks
    same = make_seq(1, range(1, 9))
    assert run_prefill(bm, same) == 4  # not 8: token 8 must be computed for its logits
    assert run_prefill(bm, make_seq(2, range(1, 2))) == 0


def test_off_by_default_and_blocks_go_straight_back_to_the_free_list():
    bm = BlockManager(8, 0, BS)
    a = make_seq(0, range(1, 9))
    assert run_prefill(bm, a) == 0
    bm.free(a)
    assert bm.prefix_cache is None and bm.device.num_free == len(bm.device.free_ids) == 8
    assert run_prefill(bm, make_seq(1, range(1, 10))) == 0


def test_lru_eviction_only_when_the_free_list_is_empty():
    bm = BlockManager(4, 0, BS, enable_prefix_caching=True)
    old, new = make_seq(0, range(1, 5)), make_seq(1, range(100, 104))
    for s in (old, new):
        run_prefill(bm, s)
        bm.free(s)  # `old` becomes evictable first: least recently used
    assert len(bm.prefix_cache.evictable) == 2 and len(bm.device.free_ids) == 2
    x = make_seq(2, [7])
    bm.allocate(x, 8)  # two blocks: the free list suffices, nothing is evicted
    assert len(bm.prefix_cache) == 2
    y = make_seq(3, [9])
    bm.allocate(y, 4)  # free list empty: the oldest cached block goes
    assert len(bm.prefix_cache) == 1
    assert bm.acquire_prefix(make_seq(4, [*range(1, 5), 0])) == 0
    z = make_seq(5, [*range(100, 104), 0])
    assert bm.acquire_prefix(z) == 4  # the newer one survived
    bm.check_integrity([x, y, z])
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(6, [1]), 4)  # z's block is referenced: nothing left to evict


def test_touching_a_cached_block_makes_it_most_recently_used():
    bm = BlockManager(3, 0, BS, enable_prefix_caching=True)
    a, b = make_seq(0, range(1, 5)), make_seq(1, range(100, 104))
    for s in (a, b):
        run_prefill(bm, s)
        bm.free(s)
    again = make_seq(2, [*range(1, 5), 0])
    assert run_prefill(bm, again) == 4  # reuses a's block, which is now the newest
    bm.free(again)
    bm.allocate(make_seq(3, [1]), 4 * 2)  # the 1 free block plus one eviction: b's block
    assert bm.acquire_prefix(make_seq(4, [*range(100, 104), 0])) == 0
    assert bm.acquire_prefix(make_seq(5, [*range(1, 5), 0])) == 4


def test_check_integrity_catches_broken_cache_state():
    bm = BlockManager(8, 0, BS, enable_prefix_caching=True)
    a = make_seq(0, range(1, 9))
    run_prefill(bm, a)
    bm.free(a)
    parked = next(iter(bm.prefix_cache.evictable))
    bm.device.free_ids.append(parked)  # a cached block also in the free list
    with pytest.raises(AssertionError):
        bm.check_integrity([])
    bm.device.free_ids.pop()
    bm.check_integrity([])
    bm.device.ref_counts[parked] = 1  # evictable yet referenced
    with pytest.raises(AssertionError):
        bm.check_integrity()


# ---- the scheduler on a simulated KV cache ------------------------------------------------------
class FakeKV:
    """Each slot holds what real KV depends on: (adapter, every token up to and including
    it). Reads of the cached positions are checked before each step's writes, after the
    swap copies, in the ModelAgent's order (swap-in, swap-out, forward)."""

    def __init__(self, num_gpu, num_cpu):
        self.dev = [[None] * BS for _ in range(num_gpu)]
        self.host = [[None] * BS for _ in range(num_cpu)]

    def step(self, out):
        for h, d in out.blocks_to_swap_in:
            self.dev[d] = list(self.host[h])
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.dev[d])
        for it in out.scheduled:
            seq = it.seq
            for p in range(it.start_pos):
                want = (seq.adapter_name, tuple(seq.token_ids[: p + 1]))
                got = self.dev[seq.block_table[p // BS]][p % BS]
                assert got == want, f"seq {seq.seq_id} reads stale KV at position {p}"
        for it in out.scheduled:
            seq = it.seq
            for p in range(it.start_pos, it.start_pos + it.num_new_tokens):
                slot = (seq.adapter_name, tuple(seq.token_ids[: p + 1]))
                self.dev[seq.block_table[p // BS]][p % BS] = slot


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("eviction", ["recompute", "swap"])
def test_scheduler_fuzz_shared_prefixes_preemption_and_swap(eviction, policy):
    rng = random.Random(0)
    num_gpu, num_cpu = 16, 12 if eviction == "swap" else 0
    bm = BlockManager(num_gpu, num_cpu, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, get_policy(policy), 8, 24, clock=lambda: 0.0, eviction_type=eviction)
    kv = FakeKV(num_gpu, num_cpu)
    systems = [[rng.randrange(1, 50) for _ in range(n)] for n in (13, 9)]
    seqs, next_id, done = [], 0, 0
    for _ in range(400):
        if next_id < 60 and rng.random() < 0.5:
            prompt = rng.choice(systems) + [
                rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))
            ]
            seq = make_seq(next_id, prompt, max_new=rng.randrange(1, 24))
            seq.adapter_name = rng.choice([None, None, "a"])
            seq.priority = rng.randrange(5)  # the priority policy: later arrivals preempt
            seqs.append(seq)
            sched.add_sequence(seq)
            next_id += 1
        if not sched.has_unfinished:
            continue
        out = sched.schedule()
        kv.step(out)
        new = {it.seq.seq_id: rng.randrange(1, 50) for it in out.scheduled if it.needs_sample}
        finished = [
            it.seq
            for it in out.scheduled
            if it.needs_sample and it.seq.num_generated_tokens + 1 >= it.seq.max_new_tokens
        ]
        done += len(finished)
        sched.update(out, new, finished)
        sched.check_integrity()
    while sched.has_unfinished:
        out = sched.schedule()
        kv.step(out)
        new = {it.seq.seq_id: 1 for it in out.scheduled if it.needs_sample}
        fin = [it.seq for it in out.scheduled if it.needs_sample]
        sched.update(out, new, fin)
        sched.check_integrity()
    stats = sched.stats()
    assert stats["num_prefix_cached_tokens"] > 100, stats
    assert stats["num_preemptions"] > 0, stats
    if eviction == "swap":
        assert stats["num_swap_outs"] > 0, stats
    if policy == "priority":
        assert stats["num_arrival_preemptions"] > 0, stats
    assert stats["num_free_blocks"] == num_gpu and stats["num_free_cpu_blocks"] == num_cpu
    assert stats["num_evictable_blocks"] == stats["num_prefix_cached_blocks"] > 0


def test_a_removed_adapter_blocks_are_never_matched_again():
    bm = BlockManager(16, 0, BS, enable_prefix_caching=True)
    running = make_seq(0, range(1, 4), adapter="sql", adapter_id=0)  # admitted before removal
    run_prefill(bm, running)
    run_prefill(bm, make_seq(1, range(1, 13), adapter="sql", adapter_id=0))
    assert run_prefill(bm, make_seq(2, range(1, 13), adapter="sql", adapter_id=0)) == 8
    # "sql" removed and added again: another registration id, other weights
    assert run_prefill(bm, make_seq(3, range(1, 13), adapter="sql", adapter_id=1)) == 0
    assert run_prefill(bm, make_seq(4, range(1, 13), adapter="sql", adapter_id=1)) == 8
    # a sequence admitted before the removal keeps its own chain: a full block it computes
    # now is not offered to the new adapter's requests
    running.token_ids += [4, 5]
    running.num_computed_tokens = 5
    bm.allocate(running, 5)
    bm.commit(running)
    fresh = make_seq(5, [1, 2, 3, 4, 9], adapter="sql", adapter_id=1)
    assert bm.acquire_prefix(fresh) == 4 and fresh.block_table[0] != running.block_table[0]
