"""The CacheEngine: the physical KV block pools (device and host) and the copies between them.

It never decides anything: block ids come from the Scheduler's BlockManager, and the swaps and
copies it performs are the ones a SchedulerOutput lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSpec:
    """Shape of one layer's KV cache block, read once from the HF config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory; on CPU, the RAM available to new allocations."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def derive_num_blocks(spec: CacheSpec, device: torch.device, fraction: float) -> int:
    return int(free_memory_bytes(device) * fraction // spec.block_bytes)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor.

    NOTE: zeros, not empty: padded attention multiplies masked slots by 0, and a NaN bit
    pattern from uninitialised memory would survive that. On CPU, numpy's calloc maps zero
    pages lazily, so a pool of several GB costs nothing until blocks are used.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={2: np.uint16, 4: np.uint32, 1: np.uint8}[itemsize])
    return torch.from_numpy(raw).view(dtype)


class CacheEngine:
    """Per-layer K and V tensors, [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self, spec: CacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> None:
        self.spec = spec
        self.device = device
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        shape = (spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            (
                _zeros((num_gpu_blocks, *shape), spec.dtype, device),
                _zeros((num_gpu_blocks, *shape), spec.dtype, device),
            )
            for _ in range(spec.num_layers)
        ]
        pin = device.type == "cuda"
        self.host_caches = [
            (
                torch.zeros(num_cpu_blocks, *shape, dtype=spec.dtype, pin_memory=pin),
                torch.zeros(num_cpu_blocks, *shape, dtype=spec.dtype, pin_memory=pin),
            )
            for _ in range(spec.num_layers if num_cpu_blocks else 0)
        ]

    def _move(self, src_caches, dst_caches, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([p[0] for p in pairs])
        dst_ids = torch.tensor([p[1] for p in pairs])
        # NOTE: index_copy_, not `dst[ids] = ...`: on CPU that index_put took ~10 ms per
        # tensor of a 20k-block pool whatever the number of blocks moved (index_copy_: 0.02 ms)
        for src_kv, dst_kv in zip(src_caches, dst_caches):
            for src, dst in zip(src_kv, dst_kv):  # K, then V
                moved = src.index_select(0, src_ids.to(src.device)).to(dst.device)
                dst.index_copy_(0, dst_ids.to(dst.device), moved)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: pairs of (host_id, device_id)."""
        self._move(self.host_caches, self.kv_caches, pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device_id, host_id)."""
        self._move(self.kv_caches, self.host_caches, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to device blocks: pairs of (src_id, dst_id)."""
        self._move(self.kv_caches, self.kv_caches, pairs)
