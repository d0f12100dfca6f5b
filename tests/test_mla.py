"""DeepSeek's multi-head latent attention over the paged latent cache: the cache holds one
[latent | rope key] row per token (its bytes per token are the latent's, asserted), v is a view
of k, swapping moves the rows and the output still equals transformers'; an int8 cache is
refused. The parity tests (tests/test_models_parity.py, "deepseek_v3") cover preemption by
recompute, chunked prefill and prefix caching; tests/test_bf16.py the latent cache in
bfloat16."""

from __future__ import annotations

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import random_prompts, run_threads
from tests.hf_reference import hf_greedy
from tests.test_models_parity import ARCHITECTURES, save_tiny_model

NEW = 10


@pytest.fixture(scope="module")
def mla_path(tmp_path_factory, smollm2_path):
    return save_tiny_model(tmp_path_factory.mktemp("mla"), smollm2_path, "deepseek_v3")


def test_the_latent_cache_holds_the_latent_and_rope_key_only(mla_path):
    overrides = ARCHITECTURES["deepseek_v3"][2]
    row = overrides["kv_lora_rank"] + overrides["qk_rope_head_dim"]  # 32 + 8
    with Engine.from_pretrained(mla_path, EngineConfig(block_size=4, num_gpu_blocks=16)) as eng:
        spec = eng.model_agent.cache_engine.spec
        assert spec.latent_dim == overrides["kv_lora_rank"]
        # bytes per token per layer: one row of the latent and the rope key, float32; per-head
        # keys and values would be 2 * heads * (nope + rope) = 2 * 4 * 24 floats
        assert spec.block_bytes == 2 * 4 * row * 4  # 2 layers, block of 4 tokens
        for k, v in eng.model_agent.cache_engine.kv_caches:
            assert tuple(k.shape) == (16, 4, 1, row)
            assert v.data_ptr() == k.data_ptr() and v.shape[-1] == overrides["kv_lora_rank"]
            assert k.untyped_storage().nbytes() == 16 * 4 * row * 4


def test_swapped_latent_blocks_give_transformers_output(mla_path):
    vocab = 49152
    prompts = random_prompts([33, 17, 25, 9, 40], vocab, seed=5)
    expected = hf_greedy(mla_path, prompts, NEW)
    # 5 prompts of up to 50 tokens in 24 blocks of 4: they cannot all stay resident
    cfg = EngineConfig(block_size=4, num_gpu_blocks=24, num_cpu_blocks=64, eviction_type="swap")
    with Engine.from_pretrained(mla_path, cfg) as engine:
        got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=NEW), together=True)
        assert [r.token_ids for r in got] == expected
        stats = engine.stats()
        assert stats["num_swap_outs"] > 0, stats
        engine.check_integrity()


def test_an_int8_latent_cache_is_refused(mla_path):
    with pytest.raises(ValueError, match="not supported for multi-head latent attention"):
        Engine.from_pretrained(mla_path, EngineConfig(kv_cache_dtype="int8", num_gpu_blocks=16))
