"""The KV pool is sized from free memory less the model's memory-mapped weights: on the CPU the
page cache holding a mapped checkpoint counts as available, though the model keeps it."""

from __future__ import annotations

import psutil
import pytest
import torch

from lmengine import Engine, EngineConfig
from lmengine.engine import cache_engine
from lmengine.engine.cache_engine import (
    CacheSpec,
    file_backed_bytes,
    free_memory_bytes,
    module_tensors,
)

MB = 1 << 20


@pytest.fixture
def mapped(tmp_path) -> torch.Tensor:
    """4 MB of float32 mapped from a file (as safetensors and GGUF files are read)."""
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(4 * MB))
    return torch.from_file(str(path), shared=True, size=MB, dtype=torch.float32)


def test_file_backed_bytes_counts_mapped_storages_once(mapped):
    anonymous = torch.zeros(MB)
    assert file_backed_bytes([anonymous]) == 0
    # a view shares its storage: counted once, whole
    assert file_backed_bytes([mapped, anonymous, mapped[10:20]]) == 4 * MB
    assert file_backed_bytes([]) == 0


def test_free_cpu_memory_leaves_out_the_mapped_weights(mapped, monkeypatch):
    class Memory:
        available = 100 * MB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    cpu = torch.device("cpu")
    assert free_memory_bytes(cpu) == 100 * MB
    assert free_memory_bytes(cpu, [mapped, torch.zeros(MB)]) == 96 * MB
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    with_weights = cache_engine.derive_num_blocks(spec, cpu, 1.0, in_use=[mapped])
    assert with_weights == 96 * MB // spec.block_bytes
    Memory.available = 3 * MB  # less than the mapped weights: no block, not a negative count
    assert cache_engine.derive_num_blocks(spec, cpu, 1.0, in_use=[mapped]) == 0


def test_the_default_models_weights_are_partly_mapped_and_left_out():
    # the float32 expansion is read from the converted checkpoint's mapped file
    with Engine.from_pretrained(None, EngineConfig(quant_policy="float")) as engine:
        model = engine.model_agent.runner.model
        assert file_backed_bytes(module_tensors(model)) > 50 * MB


def test_the_engine_sizes_its_pool_with_its_weights_in_use(tiny_llama_path, monkeypatch):
    seen: list[int] = []
    read = cache_engine.free_memory_bytes

    def spy(device, in_use=()):
        in_use = list(in_use)
        seen.append(len(in_use))
        return read(device, in_use)

    monkeypatch.setattr(cache_engine, "free_memory_bytes", spy)
    with Engine.from_pretrained(tiny_llama_path, EngineConfig()) as engine:
        model = engine.model_agent.runner.model
        assert seen == [len([*model.parameters(), *model.buffers()])]
        assert engine.model_agent.num_gpu_blocks >= 1
