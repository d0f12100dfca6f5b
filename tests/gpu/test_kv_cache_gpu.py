"""The KV pools on the device: preemption by swap through the pinned host pool (bytes come back
bit-identical, outputs equal an engine that never preempts), and the device pool sized from
`torch.cuda.mem_get_info` x `cache_max_entry_count` / block bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from lmengine import Engine, GenerationConfig
from lmengine.engine import cache_engine
from tests.gpu.common import by_mode, chat_prompts, engine_config, free_device_bytes
from tests.gpu.test_smollm2_gpu import NEW_TOKENS, NUM_PROMPTS, SMOLLM2_KERNELS, preempting_pool
from tests.test_swap import SwapRecorder, final_responses, submit_at_once

pytestmark = pytest.mark.gpu

NUM_CPU_BLOCKS = 256


def test_swap_through_pinned_host_memory(smollm2_path, device, triton_spy):
    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_path), NUM_PROMPTS)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS)
    roomy = engine_config(dtype="float32", block_size=16, num_gpu_blocks=1024)
    with Engine.from_pretrained(smollm2_path, roomy) as engine:
        expected = [r.token_ids for r in final_responses(submit_at_once(engine, prompts, gen))]
        assert engine.stats()["num_preemptions"] == 0, "the reference engine must not preempt"
    cfg = engine_config(
        dtype="float32",
        block_size=16,
        num_gpu_blocks=preempting_pool(prompts, NEW_TOKENS, 16),
        num_cpu_blocks=NUM_CPU_BLOCKS,
        eviction_type="swap",
    )
    with Engine.from_pretrained(smollm2_path, cfg) as engine:
        cache = engine.model_agent.cache_engine
        host = [t for layer in cache.host_caches for t in layer]
        assert len(cache.host_caches) == engine.info.num_layers
        assert all(t.device.type == "cpu" and t.shape[0] == NUM_CPU_BLOCKS for t in host)
        # NOTE: pinned (page-locked) on CUDA, so copies to and from the device can use DMA;
        # the CPU engine has no device to pin for
        assert [t.is_pinned() for t in host] == [device.type == "cuda"] * len(host)
        assert all(t.device.type == device.type for layer in cache.kv_caches for t in layer)
        recorder = SwapRecorder(cache)
        got = final_responses(submit_at_once(engine, prompts, gen))
        for i, (r, exp) in enumerate(zip(got, expected)):
            assert r.finish_reason in ("stop", "length"), r.error
            assert r.token_ids == exp, f"prompt {i} differs from the engine that never preempts"
        stats = engine.stats()
        assert stats["num_swap_outs"] > 0, stats
        assert stats["num_swap_ins"] == stats["num_swap_outs"]
        # every block swapped out came back bit-identical
        assert recorder.num_checked == stats["num_swapped_blocks"] and not recorder.mismatches
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"] == NUM_CPU_BLOCKS
        engine.check_integrity()
    triton_spy.assert_ran(*SMOLLM2_KERNELS)


# Free memory moves between the reading before the load and the engine's own reading by what
# the load takes: the weights, with room for a second copy while patching fuses them, plus
# allocator rounding. On the shared CPU of the dry run other processes move it too.
LOAD_SLACK = by_mode(gpu=256 << 20, cpu=4 << 30)
OTHERS_SLACK = by_mode(gpu=64 << 20, cpu=4 << 30)


@pytest.mark.parametrize(
    "dtype,block_size,fraction", [("float32", 16, 0.05), ("bfloat16", 32, 0.1)]
)
def test_pool_sized_from_free_memory(
    smollm2_path, device, monkeypatch, dtype, block_size, fraction
):
    readings: list[int] = []
    read = cache_engine.free_memory_bytes

    def spy(dev: torch.device, in_use=()) -> int:
        assert dev.type == device.type, f"free memory read on {dev}, the engine runs on {device}"
        readings.append(read(dev, in_use))
        return readings[-1]

    monkeypatch.setattr(cache_engine, "free_memory_bytes", spy)
    hf = AutoConfig.from_pretrained(smollm2_path)
    head_dim = hf.hidden_size // hf.num_attention_heads
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # keys and values of every layer, block_size tokens, every KV head
    block_bytes = 2 * hf.num_hidden_layers * block_size * hf.num_key_value_heads * head_dim
    block_bytes *= element
    free_before = free_device_bytes(device)
    cfg = engine_config(
        dtype=dtype, block_size=block_size, num_gpu_blocks=0, cache_max_entry_count=fraction
    )
    with Engine.from_pretrained(smollm2_path, cfg) as engine:
        agent = engine.model_agent
        assert readings, "the pool was not sized from free memory"
        assert agent.cache_engine.spec.block_bytes == block_bytes
        num_blocks = agent.num_gpu_blocks
        assert num_blocks in [int(free * fraction // block_bytes) for free in readings]
        tensors = {t.data_ptr(): t for t in agent.model.state_dict().values()}  # tied: once
        weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        for free in readings:  # read after the load, which took its weights
            assert free <= free_before + OTHERS_SLACK
            assert free >= free_before - 2 * weight_bytes - LOAD_SLACK, (free_before, free)
        pool = [t for layer in agent.cache_engine.kv_caches for t in layer]
        assert all(t.device.type == device.type and t.shape[0] == num_blocks for t in pool)
        assert sum(t.numel() * t.element_size() for t in pool) == num_blocks * block_bytes
        if device.type == "cuda":  # the pool is really allocated on the device
            assert torch.cuda.memory_allocated(device) >= num_blocks * block_bytes
            assert free_device_bytes(device) <= free_before - num_blocks * block_bytes
        gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
        r = engine.create_instance().infer(0, [1, 2, 3, 4, 5], gen_config=gen)
        assert r.finish_reason == "length" and len(r.token_ids) == 8
