"""The CacheEngine: the physical KV block pools (device and host) and the copies between them.

It never decides anything: block ids come from the Scheduler's BlockManager, and the swaps and
copies it performs are the ones a SchedulerOutput lists.

Each layer's cache is a tuple of tensors indexed by block id on their first dimension:
(k, v) in the model's dtype, or with kv_cache_dtype="int8" (k, v, k_scale, v_scale): int8
pages and one float32 scale per (slot, KV head) (lmengine/kernels/kv_quant.py). Swaps and
copies move every tensor of the tuple, so the scales always travel with their blocks. A
latent cache (multi-head latent attention) is one tensor per layer, [latent | rope key] per
token, and its v is a view of k's first `latent_dim` dims: the tuple is still (k, v), and
only k moves.
"""

from __future__ import annotations

import bisect
import logging
import math
import mmap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from lmengine.engine.step import StepInput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSpec:
    """Shape of one layer's KV cache block, read once from the HF config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's (compute) dtype
    kv_cache_dtype: str = "auto"  # "auto": K/V stored in `dtype`; "int8": int8 + scales
    latent_dim: int | None = None  # a latent cache: v is k's first latent_dim dims

    def __post_init__(self) -> None:
        if self.latent_dim is not None and self.quantized:
            raise ValueError(
                "kv_cache_dtype='int8' is not supported for multi-head latent attention "
                "(DeepSeek): its cache already holds one compressed latent per token, not "
                "per-head keys and values; use kv_cache_dtype='auto'"
            )

    @classmethod
    def for_model(cls, info, cfg, dtype: torch.dtype, num_kv_heads: int | None = None) -> CacheSpec:
        """The block shape of a model (`ModelInfo`) under an `EngineConfig`; `num_kv_heads`:
        a tensor-parallel rank's share of the KV heads (default: all of them)."""
        heads = info.num_kv_heads if num_kv_heads is None else num_kv_heads
        return cls(
            info.num_layers,
            heads,
            info.head_dim,
            cfg.block_size,
            dtype,
            cfg.kv_cache_dtype,
            getattr(info, "latent_dim", None),
        )

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype == "int8"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values (and their scales)."""
        if self.quantized:
            row = self.head_dim + 4  # int8 values and one float32 scale per (slot, head)
        else:
            row = self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        tensors = 1 if self.latent_dim is not None else 2  # a latent cache has no separate v
        return tensors * self.num_layers * self.block_size * self.num_kv_heads * row

    @property
    def gather_token_bytes(self) -> int:
        """K + V bytes of one token in one layer once read for attention, in `dtype` (what the
        CPU gather path materialises, int8 or not)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        if self.latent_dim is not None:  # the latent blocks are read once, for k and v
            return self.num_kv_heads * self.head_dim * elem
        return 2 * self.num_kv_heads * self.head_dim * elem

    def layer_tensors(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor of one layer's cache tuple for `num_blocks` blocks."""
        page = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.latent_dim is not None:
            return [(page, self.dtype)]  # v: a view of it (`layer_cache`)
        if not self.quantized:
            return [(page, self.dtype)] * 2
        return [(page, torch.int8)] * 2 + [(page[:3], torch.float32)] * 2


def free_memory_bytes(device: torch.device, in_use: Iterable[torch.Tensor] = ()) -> int:
    """Free device memory; on CPU, the RAM available to new allocations, less the tensors of
    `in_use` (a model's weights) that are memory-mapped from a file: the kernel counts the page
    cache holding them as available, though the model keeps reading them."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available - file_backed_bytes(in_use)


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A model's parameters and buffers, for `free_memory_bytes`' `in_use`."""
    return [*module.parameters(), *module.buffers()]


def file_backed_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages of these CPU tensors that lie in file mappings of this process
    (/proc/self/maps; 0 where it cannot be read), each storage counted once."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    starts, ends = [], []  # ascending: the kernel lists the mappings by address
    for line in lines:
        fields = line.split(maxsplit=5)
        # address range, perms, offset, device, inode, path: a file's inode is not 0
        if len(fields) == 6 and fields[4] != "0":
            start, end = fields[0].split("-")
            starts.append(int(start, 16))
            ends.append(int(end, 16))
    seen, total = set(), 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address in seen or storage.nbytes() == 0:
            continue
        seen.add(address)
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < ends[i]:
            total += storage.nbytes()
    return total


def derive_num_blocks(
    spec: CacheSpec,
    device: torch.device,
    fraction: float,
    *sharing: CacheSpec,
    in_use: Iterable[torch.Tensor] = (),
) -> int:
    """Blocks that `fraction` of free memory holds. `sharing`: caches addressed by the same
    block ids (a speculative draft model's), so each block costs theirs too. `in_use`: the
    model's tensors (see `free_memory_bytes`)."""
    block_bytes = spec.block_bytes + sum(other.block_bytes for other in sharing)
    return int(max(0, free_memory_bytes(device, in_use)) * fraction // block_bytes)


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool = False
) -> torch.Tensor:
    """A zero-filled cache tensor; on the CPU in transparent huge pages if `huge_pages`.

    NOTE: zeros, not empty: padded attention multiplies masked slots by 0, and a NaN bit
    pattern from uninitialised memory would survive that. On the CPU it is an anonymous
    mapping of its own: zero pages, mapped lazily, so a pool of several GB costs nothing until
    blocks are used, and unmapped with the pool. calloc (numpy's zeros) served it from a heap
    the process had freed memory to (malloc.py keeps it) and zeroed it with memset: 60 x 79 MB
    (SmolLM2's default pool) in 1.45 s after 4.8 GB were freed, and in ~15 s on memory a VM
    had not backed yet; the mapping takes a millisecond either way (Intel Xeon, 2026-12-04).

    Huge pages (madvise, where the kernel has them) for a pool mapped at start (`map_now`): a
    step's rotary writes and attention reads reach K/V blocks all over a pool of gigabytes,
    one TLB entry per 4 KiB page; `lmengine serve`'s first burst of 64 prompts (SmolLM2,
    bfloat16, a 4.7 GB pool) reached its median first token in 745-845 ms in huge pages
    against 1,025-1,300 in 4 KiB pages (page faults per burst alike; Intel Xeon family 6
    model 167, 2026-12-04). A pool mapped lazily keeps 4 KiB pages: there each first write
    faults a whole 2 MB page in, zeroed, inside a step (offline README generation 815-846
    against 1,171-1,207 output tok/s, three alternating runs).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # no anonymous private maps (Windows)
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    # the tensor holds the mapping: unmapped when the tensor goes
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def map_now(t: torch.Tensor) -> int:
    """Write a zero into every page of the contiguous CPU tensor `t` (already all zeros), so
    that the OS maps its memory now rather than page by page inside the steps that first use
    it; the bytes it spans."""
    flat = t.view(-1).view(torch.uint8)
    flat[:: mmap.PAGESIZE].zero_()
    return flat.numel()


class CacheEngine:
    """Per-layer K and V tensors, [num_blocks, block_size, num_kv_heads, head_dim] (int8 KV:
    plus K and V scales, [num_blocks, block_size, num_kv_heads] float32).

    `prefault` (CPU): map the device pool's memory at once (`EngineConfig.prefault_kv_cache`).
    """

    def __init__(
        self,
        spec: CacheSpec,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        device: torch.device,
        prefault: bool = False,
    ) -> None:
        self.spec = spec
        self.device = device
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        device_layer = spec.layer_tensors(num_gpu_blocks)
        layers = [
            [_zeros(shape, dtype, device, huge_pages=prefault) for shape, dtype in device_layer]
            for _ in range(spec.num_layers)
        ]
        if prefault and device.type == "cpu":
            start = time.perf_counter()
            size = sum(map_now(t) for tensors in layers for t in tensors)
            logger.info(
                "KV pool: %.2f GB mapped in %.1f s", size / 1e9, time.perf_counter() - start
            )
        self.kv_caches = [self._layer(tensors) for tensors in layers]
        pin = device.type == "cuda"
        host_layer = spec.layer_tensors(num_cpu_blocks)
        self.host_caches = [
            self._layer(
                [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in host_layer]
            )
            for _ in range(spec.num_layers if num_cpu_blocks else 0)
        ]

    def _layer(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One layer's cache tuple from its own tensors: a latent cache's v is a view of k."""
        if self.spec.latent_dim is None:
            return tuple(tensors)
        (k,) = tensors
        return k, k[..., : self.spec.latent_dim]

    def _move(self, src_caches, dst_caches, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([p[0] for p in pairs])
        dst_ids = torch.tensor([p[1] for p in pairs])
        # NOTE: index_copy_, not `dst[ids] = ...`: on CPU that index_put took ~10 ms per
        # tensor of a 20k-block pool whatever the number of blocks moved (index_copy_: 0.02 ms)
        owned = 1 if self.spec.latent_dim is not None else None  # a latent v is k's view
        for src_layer, dst_layer in zip(src_caches, dst_caches):
            for src, dst in zip(src_layer[:owned], dst_layer[:owned]):  # K, V (and scales)
                moved = src.index_select(0, src_ids.to(src.device)).to(dst.device)
                dst.index_copy_(0, dst_ids.to(dst.device), moved)

    def apply(self, inputs: StepInput) -> None:
        """A step's block moves (`StepInput`), in the order its docstring gives: copies, then
        swap-outs, then swap-ins."""
        self.copy(inputs.blocks_to_copy)
        self.swap_out(inputs.blocks_to_swap_out)
        self.swap_in(inputs.blocks_to_swap_in)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: pairs of (host_id, device_id)."""
        self._move(self.host_caches, self.kv_caches, pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device_id, host_id)."""
        self._move(self.kv_caches, self.host_caches, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to device blocks: pairs of (src_id, dst_id)."""
        self._move(self.kv_caches, self.kv_caches, pairs)
