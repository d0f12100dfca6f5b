"""Greedy float32 output equals transformers `generate`, token for token, under any batching,
block size, preemption, chunked prefill and thread interleaving."""

from __future__ import annotations

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import random_prompts, run_threads
from tests.hf_reference import hf_greedy

TINY_LENGTHS = [1, 5, 17, 33, 64, 3, 100, 9, 48, 2]
TINY_NEW = 24


@pytest.fixture(scope="module")
def tiny_case(tiny_llama_path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_path).vocab_size
    prompts = random_prompts(TINY_LENGTHS, vocab, seed=1)
    expected = hf_greedy(tiny_llama_path, prompts, TINY_NEW)
    return tiny_llama_path, prompts, expected


TINY_CONFIGS = {
    "block1": dict(block_size=1, num_gpu_blocks=4096),
    "block4": dict(block_size=4, num_gpu_blocks=1024),
    "block16": dict(block_size=16, num_gpu_blocks=256),
    # 124 tokens at most per sequence = 31 blocks: the pool holds barely two sequences
    "preempt": dict(block_size=4, num_gpu_blocks=40),
    "chunked": dict(block_size=4, num_gpu_blocks=1024, max_prefill_token_num=7),
    "batch2": dict(block_size=16, num_gpu_blocks=256, max_batch_size=2),
}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_llama_matches_transformers(tiny_case, name):
    path, prompts, expected = tiny_case
    engine = Engine.from_pretrained(path, EngineConfig(**TINY_CONFIGS[name]))
    try:
        gen = GenerationConfig(max_new_tokens=TINY_NEW)
        # preempt: every request at once, since a tiny model's request can finish within
        # the stagger on a fast CPU, and then nothing ever competes for the pool
        preempt = name == "preempt"
        got = run_threads(
            engine, prompts, gen, stagger_s=0.0 if preempt else 0.01, together=preempt
        )
        for i, (r, exp) in enumerate(zip(got, expected)):
            assert r.finish_reason in ("stop", "length"), r.error
            assert r.token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens) differs"
        stats = engine.stats()
        if name == "preempt":
            assert stats["num_preemptions"] > 0, "the tiny pool was meant to force preemption"
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.check_integrity()
    finally:
        engine.close()


def test_tiny_llama_few_threads_staggered(tiny_case):
    path, prompts, expected = tiny_case
    engine = Engine.from_pretrained(path, EngineConfig(block_size=4, num_gpu_blocks=60))
    try:
        got = run_threads(
            engine,
            prompts,
            GenerationConfig(max_new_tokens=TINY_NEW),
            num_threads=3,
            stagger_s=0.05,
        )
        assert [r.token_ids for r in got] == expected
        engine.check_integrity()
    finally:
        engine.close()
