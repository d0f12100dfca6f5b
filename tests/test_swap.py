"""Preemption by swap on a real model: swapped KV bytes come back bit-identical (CacheEngine and
end to end), and greedy float32 output equals transformers while a tiny pool forces many swaps
and, with a tiny host pool, recomputes too."""

from __future__ import annotations

import random

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine.cache_engine import CacheEngine, CacheSpec
from lmengine.engine.request import Answer
from tests.engine_utils import loop_held, random_prompts
from tests.hf_reference import hf_greedy

_rng = random.Random(5)
LENGTHS = [_rng.randint(1, 60) for _ in range(24)]
NEW = 20


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (NaN payloads and signed zeros included)."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_engine_swap_round_trip_is_bit_identical(dtype):
    spec = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = CacheEngine(spec, num_gpu_blocks=10, num_cpu_blocks=6, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for k, v in cache.kv_caches:  # random bit patterns: NaNs, infs, subnormals, -0.0
        bits(k).copy_(torch.randint(0, 256, bits(k).shape, dtype=torch.uint8, generator=gen))
        bits(v).copy_(torch.randint(0, 256, bits(v).shape, dtype=torch.uint8, generator=gen))
    before = [(bits(k).clone(), bits(v).clone()) for k, v in cache.kv_caches]
    out_pairs = [(7, 0), (2, 5), (9, 3)]  # (device, host)
    cache.swap_out(out_pairs)
    for k, v in cache.kv_caches:
        k.zero_()
        v.zero_()
    in_pairs = [(0, 1), (5, 8), (3, 4)]  # (host, device): other device blocks than before
    cache.swap_in(in_pairs)
    for (k, v), (k0, v0) in zip(cache.kv_caches, before):
        for (d_old, _), (_, d_new) in zip(out_pairs, in_pairs):
            assert torch.equal(bits(k)[d_new], k0[d_old]) and torch.equal(bits(v)[d_new], v0[d_old])
    cache.copy([(1, 6)])
    for k, v in cache.kv_caches:
        assert torch.equal(bits(k)[6], bits(k)[1]) and torch.equal(bits(v)[6], bits(v)[1])


@pytest.fixture(scope="module")
def tiny_case(tiny_llama_path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_path).vocab_size
    prompts = random_prompts(LENGTHS, vocab, seed=1)
    return tiny_llama_path, prompts, hf_greedy(tiny_llama_path, prompts, NEW)


class SwapRecorder:
    """Wraps a CacheEngine's swaps on the loop thread: remembers the bytes of every block when
    it is swapped out and compares them with the device block it is swapped back into."""

    def __init__(self, cache: CacheEngine) -> None:
        self.cache = cache
        self.saved: dict[int, list[torch.Tensor]] = {}  # host id -> bytes per layer, K and V
        self.num_checked = 0
        self.mismatches: list[int] = []
        orig_out, orig_in = cache.swap_out, cache.swap_in

        def swap_out(pairs):
            for d, h in pairs:
                self.saved[h] = [bits(t[d]).clone() for kv in cache.kv_caches for t in kv]
            orig_out(pairs)

        def swap_in(pairs):
            orig_in(pairs)
            for h, d in pairs:
                now = [bits(t[d]) for kv in cache.kv_caches for t in kv]
                if not all(torch.equal(a, b) for a, b in zip(now, self.saved.pop(h))):
                    self.mismatches.append(d)
                self.num_checked += 1

        cache.swap_out, cache.swap_in = swap_out, swap_in


@pytest.mark.parametrize(
    "policy,max_batch_size,min_swaps,min_recomputes",
    [("fcfs", 128, 4, 2), ("priority", 4, 2, 0)],
)
def test_parity_with_transformers_under_many_swaps_and_recomputes(
    tiny_case, policy, max_batch_size, min_swaps, min_recomputes
):
    num_cpu_blocks = 16
    path, prompts, expected = tiny_case
    # 24 prompts of 1-60 tokens + 20 new ones, 80 device token slots: the pool holds a few
    # sequences; the host pool holds some swapped ones, the rest fall back to recompute
    cfg = EngineConfig(
        block_size=2,
        num_gpu_blocks=40,
        num_cpu_blocks=num_cpu_blocks,
        eviction_type="swap",
        scheduling_policy=policy,
        max_batch_size=max_batch_size,
    )
    engine = Engine.from_pretrained(path, cfg)
    try:
        recorder = SwapRecorder(engine.model_agent.cache_engine)
        gen = GenerationConfig(max_new_tokens=NEW)
        if policy == "priority":  # later arrivals with higher priorities preempt running ones
            got = _run_with_priorities(engine, prompts, gen)
        else:
            got = final_responses(submit_at_once(engine, prompts, gen))
        for i, (r, exp) in enumerate(zip(got, expected)):
            assert r.finish_reason in ("stop", "length"), r.error
            assert r.token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens) differs"
        stats = engine.stats()
        assert stats["num_swap_outs"] >= min_swaps and stats["num_recomputes"] >= min_recomputes, (
            stats
        )
        assert stats["num_swap_ins"] == stats["num_swap_outs"]
        if policy == "priority":
            assert stats["num_arrival_preemptions"] >= 1, "later, higher priorities preempt"
        assert recorder.num_checked == stats["num_swapped_blocks"] and not recorder.mismatches
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"] == num_cpu_blocks
        engine.check_integrity()
    finally:
        engine.close()


def submit_at_once(engine, prompts, gens, priorities=None, user_ids=None, first_id=0):
    """Submit every request while the loop is held between steps, so that they all arrive
    in the same step, in list order; returns their response queues."""
    client = engine.client
    queues = []
    with loop_held(engine, num_pending=len(prompts)):
        for i, ids in enumerate(prompts):
            req = client.request(
                ids,
                gens[i] if isinstance(gens, list) else gens,
                request_id=first_id + i,
                priority=None if priorities is None else priorities[i],
                user_id=None if user_ids is None else user_ids[i],
            )
            client.submit(req)
            queues.append(req.response_queue)
    return queues


def final_responses(queues, timeout=600):
    """Each queue's whole answer, assembled from the engine's deltas."""
    results = []
    for q in queues:
        answer = Answer()
        while True:
            answer.add(r := q.get(timeout=timeout))
            if r.finish_reason is not None:
                results.append(answer.response(copy=False))
                break
    return results


def _run_with_priorities(engine, prompts, gen):
    """Two waves: low priorities fill the pool, then higher ones arrive and preempt them."""
    import time

    half = len(prompts) // 2
    first = submit_at_once(engine, prompts[:half], gen, priorities=[i % 2 for i in range(half)])
    deadline = time.monotonic() + 60
    while True:  # until the first wave runs and has a backlog: no room for newcomers
        stats = engine.stats()
        if stats["num_running"] and stats["num_waiting"] + stats["num_swapped"]:
            break
        assert time.monotonic() < deadline, "the first wave never ran with a backlog"
        time.sleep(0.002)
    second = submit_at_once(
        engine,
        prompts[half:],
        gen,
        priorities=[2 + i % 3 for i in range(len(prompts) - half)],
        first_id=half,
    )
    return final_responses(first + second)
