"""Paged KV block bookkeeping: block ids, free lists, reference counts. Pure Python.

A sequence's block table is a `list[int]`; token p of the sequence lives in block
`block_table[p // block_size]` at offset `p % block_size`. The BlockManager never touches
tensors: the CacheEngine owns the memory these ids index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from lmengine.scheduler.sequence import Sequence


class BlockPool:
    """A fixed set of block ids with a free list and per-block reference counts."""

    def __init__(self, num_blocks: int, name: str = "device") -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, num: int) -> list[int]:
        if num > len(self.free_ids):
            raise RuntimeError(f"{self.name} pool: asked for {num} blocks, {self.num_free} free")
        ids = [self.free_ids.popleft() for _ in range(num)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        for i in block_ids:
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"{self.name} pool: block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)

    def check_integrity(self, owners: Iterable[list[int]] = ()) -> None:
        """Raise AssertionError unless free list and reference counts agree with each other
        and, when `owners` (every live block table) is given, with the owners."""
        free = list(self.free_ids)
        assert len(set(free)) == len(free), f"{self.name}: duplicate ids in the free list"
        for i in free:
            assert self.ref_counts[i] == 0, f"{self.name}: free block {i} has references"
        used = [i for i, c in enumerate(self.ref_counts) if c > 0]
        assert len(used) + len(free) == self.num_blocks, f"{self.name}: blocks lost"
        counts = [0] * self.num_blocks
        for table in owners:
            for i in table:
                counts[i] += 1
        if owners != ():
            assert counts == self.ref_counts, f"{self.name}: reference counts != owners"


class BlockManager:
    """Device and host block pools for one engine; allocates blocks to sequences."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_gpu_blocks, "device")
        self.host = BlockPool(num_cpu_blocks, "host")

    def num_required_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its first `num_tokens` tokens have slots."""
        total = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_required_blocks(seq, num_tokens) <= self.device.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        seq.block_table.extend(self.device.allocate(self.num_required_blocks(seq, num_tokens)))

    def can_append(self, seq: Sequence) -> bool:
        return self.can_allocate(seq, seq.num_computed_tokens + 1)

    def append(self, seq: Sequence) -> None:
        self.allocate(seq, seq.num_computed_tokens + 1)

    def free(self, seq: Sequence) -> None:
        """Release every block `seq` holds, on the device and on the host."""
        self.device.free(seq.block_table)
        seq.block_table = []
        self.host.free(seq.host_block_table)
        seq.host_block_table = []

    # ---- swap --------------------------------------------------------------------------------
    def num_cached_blocks(self, seq: Sequence) -> int:
        """Device blocks that hold computed KV (the rest of the table has no data yet)."""
        return min(len(seq.block_table), -(-seq.num_computed_tokens // self.block_size))

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_cached_blocks(seq) <= self.host.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s cached blocks to the host pool; returns (device_id, host_id) pairs.

        NOTE: the device blocks are free again at once. The CacheEngine copies them out before
        the step's forward writes anything, so a block reused in the same step is safe.
        """
        num = self.num_cached_blocks(seq)
        host_ids = self.host.allocate(num)
        pairs = list(zip(seq.block_table[:num], host_ids))
        self.device.free(seq.block_table)
        seq.block_table = []
        seq.host_block_table = host_ids
        return pairs

    def can_swap_in(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the host blocks of `seq` and slots for its first `num_tokens` tokens fit."""
        total = max(len(seq.host_block_table), -(-num_tokens // self.block_size))
        return total <= self.device.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring `seq`'s host blocks back to fresh device blocks; returns (host_id, device_id)."""
        device_ids = self.device.allocate(len(seq.host_block_table))
        pairs = list(zip(seq.host_block_table, device_ids))
        self.host.free(seq.host_block_table)
        seq.host_block_table = []
        seq.block_table = device_ids
        return pairs

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    def check_integrity(self, sequences: Iterable[Sequence] | None = None) -> None:
        """Both pools: free lists and reference counts agree, and (given every live sequence)
        each block is referenced exactly by the tables that hold it."""
        seqs = None if sequences is None else list(sequences)
        self.device.check_integrity(() if seqs is None else [s.block_table for s in seqs])
        self.host.check_integrity(() if seqs is None else [s.host_block_table for s in seqs])
