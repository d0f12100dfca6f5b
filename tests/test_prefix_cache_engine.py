"""Prefix caching end to end on a tiny random Llama: greedy float32 output equals transformers
(and the same engine without the cache) under preemption by recompute and by swap and from
several threads; a shared prefix is computed once; multi-turn chats reuse their history."""

from __future__ import annotations

import random

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import run_threads
from tests.hf_reference import hf_greedy
from tests.test_swap import final_responses, submit_at_once

NEW = 12


def shared_prefix_prompts(seed: int = 3) -> list[list[int]]:
    """Prompts made of one of three "system prompts" and a short distinct tail; a few repeat
    exactly (then everything but the last token can come from the cache)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 1000) for _ in range(n)] for n in (37, 22, 48)]
    prompts = []
    for i in range(14):
        tail = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 9))]
        prompts.append(systems[i % 3] + tail)
    prompts += [list(prompts[0]), list(prompts[4])]
    return prompts


@pytest.fixture(scope="module")
def case(tiny_llama_path):
    prompts = shared_prefix_prompts()
    return tiny_llama_path, prompts, hf_greedy(tiny_llama_path, prompts, NEW)


def _config(caching: bool, eviction: str = "recompute", **kw) -> EngineConfig:
    # 30 blocks of 4 tokens: a few sequences of up to 69 tokens fit at once -> preemption
    return EngineConfig(
        block_size=4,
        num_gpu_blocks=30,
        num_cpu_blocks=12 if eviction == "swap" else 0,
        eviction_type=eviction,
        enable_prefix_caching=caching,
        **kw,
    )


@pytest.mark.parametrize("eviction", ["recompute", "swap"])
def test_parity_with_and_without_prefix_caching_under_preemption(case, eviction):
    path, prompts, expected = case
    gen = GenerationConfig(max_new_tokens=NEW)
    stats = {}
    for caching in (False, True):
        engine = Engine.from_pretrained(path, _config(caching, eviction))
        try:
            got = final_responses(submit_at_once(engine, prompts, gen))
            for i, (r, exp) in enumerate(zip(got, expected)):
                assert r.finish_reason in ("stop", "length"), r.error
                assert r.token_ids == exp, f"caching={caching}: prompt {i} differs"
            engine.check_integrity()
            stats[caching] = s = engine.stats()
            assert s["num_free_blocks"] == s["num_total_blocks"]
            assert s["num_preemptions"] > 0, s
            if eviction == "swap":
                assert s["num_free_cpu_blocks"] == s["num_total_cpu_blocks"]
                assert s["num_swap_outs"] > 0, s
        finally:
            engine.close()
    on, off = stats[True], stats[False]
    assert off["num_prefix_cached_tokens"] == 0 and on["num_prefix_cached_tokens"] > 0
    assert on["num_computed_prompt_tokens"] < off["num_computed_prompt_tokens"]
    assert on["num_prefix_cached_blocks"] == on["num_evictable_blocks"] > 0


def test_parity_from_several_threads(case):
    path, prompts, expected = case
    engine = Engine.from_pretrained(path, _config(True, max_batch_size=6))
    try:
        got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=NEW), num_threads=4)
        assert [r.token_ids for r in got] == expected
        engine.check_integrity()
        assert engine.stats()["num_prefix_cached_tokens"] > 0
    finally:
        engine.close()


def test_second_request_computes_only_what_is_not_cached(tiny_llama_path):
    rng = random.Random(11)
    system = [rng.randrange(3, 1000) for _ in range(30)]
    first, second = system + [5, 6, 7], system + [8, 9]
    engine = Engine.from_pretrained(tiny_llama_path, _config(True))
    try:
        inst = engine.create_instance()
        gen = GenerationConfig(max_new_tokens=4)
        inst.infer(0, first, gen_config=gen)
        before = engine.stats()
        r = inst.infer(1, second, gen_config=gen)
        after = engine.stats()
        # 7 full blocks of the 30 shared tokens (28 tokens) come from the cache
        assert after["num_prefix_cached_tokens"] - before["num_prefix_cached_tokens"] == 28
        computed = after["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"]
        assert computed == len(second) - 28
        assert r.token_ids == hf_greedy(tiny_llama_path, [second], 4)[0]

        # multi-turn: the next turn's prompt is the history; all its full blocks are reused,
        # the generated tokens' blocks included
        third = second + r.token_ids + [10, 11, 12]
        r3 = inst.infer(2, third, gen_config=gen)
        final = engine.stats()
        reused = final["num_prefix_cached_tokens"] - after["num_prefix_cached_tokens"]
        assert reused == (len(second) + len(r.token_ids) - 1) // 4 * 4
        assert r3.token_ids == hf_greedy(tiny_llama_path, [third], 4)[0]
        engine.check_integrity()
    finally:
        engine.close()


def test_adapters_never_share_blocks_and_a_re_added_name_gets_fresh_kv(
    tiny_llama_path,
    adapter_paths,
):
    from lmengine.api import Pipeline
    from tests.test_lora import peft_greedy

    rng = random.Random(4)
    system = [rng.randrange(3, 1000) for _ in range(20)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(3)] for _ in range(6)]
    names = ["qv4", None, "ko16", "qv4", None, "ko16"]
    expected = peft_greedy(tiny_llama_path, adapter_paths, prompts, names, NEW)
    gen = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    cfg = _config(True, adapters=adapter_paths)
    engine = Engine.from_pretrained(tiny_llama_path, cfg)
    try:
        pipe = Pipeline(engine)
        for _ in range(2):  # the second round runs on a warm cache
            outs = pipe(prompts, gen_config=gen, adapter_name=names)
            assert [o.token_ids for o in outs] == expected
        assert engine.stats()["num_prefix_cached_tokens"] >= 6 * 20 // 4 * 4
        # "qv4" removed and re-added with other weights: its cached KV must not be reused
        engine.remove_adapter("qv4")
        engine.add_adapter("qv4", adapter_paths["ko16"])
        out = pipe(prompts[0], gen_config=gen, adapter_name="qv4")
        assert (
            out.token_ids
            == peft_greedy(tiny_llama_path, adapter_paths, [prompts[0]], ["ko16"], NEW)[0]
        )
        engine.check_integrity()
    finally:
        engine.close()


def test_reset_prefix_cache_drops_unused_blocks(tiny_llama_path):
    from lmengine import Engine, EngineConfig, GenerationConfig

    cfg = EngineConfig(block_size=4, num_gpu_blocks=64, enable_prefix_caching=True)
    prompt = list(range(10, 40))
    with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
        inst = engine.create_instance()
        inst.infer(0, prompt, gen_config=GenerationConfig(max_new_tokens=2))
        assert engine.stats()["num_prefix_cached_blocks"] > 0
        dropped = engine.reset_prefix_cache()
        stats = engine.stats()
        assert dropped > 0 and stats["num_prefix_cached_blocks"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.check_integrity()
        inst.infer(1, prompt, gen_config=GenerationConfig(max_new_tokens=2))
        assert engine.stats()["num_prefix_cached_tokens"] == 0  # recomputed, not reused
