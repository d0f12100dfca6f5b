"""Paged KV block bookkeeping: block ids, free lists, reference counts. Pure Python.

A sequence's block table is a `list[int]`; token p of the sequence lives in block
`block_table[p // block_size]` at offset `p % block_size`. The BlockManager never touches
tensors: the CacheEngine owns the memory these ids index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from lmengine.scheduler.prefix_cache import PrefixCache, block_key
from lmengine.scheduler.sequence import Sequence


class BlockPool:
    """A fixed set of block ids with a free list and per-block reference counts.

    With a `cache` (prefix caching), a block whose last reference goes away but which holds a
    cached prefix stays out of the free list as evictable; it still counts as free and is
    evicted (least recently used first) only when the free list is empty.
    """

    def __init__(self, num_blocks: int, name: str = "device", cache: PrefixCache | None = None):
        self.name = name
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.cache = cache

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + (len(self.cache.evictable) if self.cache is not None else 0)

    def allocate(self, num: int) -> list[int]:
        if num > self.num_free:
            raise RuntimeError(f"{self.name} pool: asked for {num} blocks, {self.num_free} free")
        # NOTE: last freed, first reused: those blocks' lines are likely still in the CPU's
        # caches, where the oldest free block is cold. A 900-token prefill step's cache writes
        # (rotary_fill_kv) took 31 ms over 30 layers taking from the front, 6.6 from the back.
        ids = [self.free_ids.pop() if self.free_ids else self.cache.evict() for _ in range(num)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def acquire(self, block_id: int) -> None:
        """One more reference to a cached block (it leaves the evictable set if it was there)."""
        if self.ref_counts[block_id] == 0:
            self.cache.unpark(block_id)
        self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        for i in block_ids:
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"{self.name} pool: block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0 and not (self.cache is not None and self.cache.park(i)):
                self.free_ids.append(i)

    def check_integrity(self, owners: Iterable[list[int]] = ()) -> None:
        """Raise AssertionError unless free list and reference counts agree with each other
        and, when `owners` (every live block table) is given, with the owners."""
        free = list(self.free_ids)
        assert len(set(free)) == len(free), f"{self.name}: duplicate ids in the free list"
        for i in free:
            assert self.ref_counts[i] == 0, f"{self.name}: free block {i} has references"
        used = [i for i, c in enumerate(self.ref_counts) if c > 0]
        parked = list(self.cache.evictable) if self.cache is not None else []
        assert not set(parked) & set(free), f"{self.name}: evictable block in the free list"
        assert len(used) + len(free) + len(parked) == self.num_blocks, f"{self.name}: blocks lost"
        if self.cache is not None:
            self.cache.check_integrity(self.ref_counts)
        counts = [0] * self.num_blocks
        for table in owners:
            for i in table:
                counts[i] += 1
        if owners != ():
            assert counts == self.ref_counts, f"{self.name}: reference counts != owners"


class BlockManager:
    """Device and host block pools for one engine; allocates blocks to sequences."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.device = BlockPool(num_gpu_blocks, "device", self.prefix_cache)
        self.host = BlockPool(num_cpu_blocks, "host")
        self.num_prefix_hit_blocks = 0  # cached blocks reused by admitted sequences, in total

    # ---- prefix caching ----------------------------------------------------------------------
    def _key(self, seq: Sequence, i: int) -> bytes:
        """Key of `seq`'s full block i (keys of blocks 0..i-1 are in seq.block_keys)."""
        bs = self.block_size
        if seq.cache_salt is None:
            seq.cache_salt = self.prefix_cache.salt(seq.adapter_name, seq.adapter_id)
        prev = seq.block_keys[i - 1] if i else seq.cache_salt
        return block_key(prev, seq.adapter_name, seq.token_ids[i * bs : (i + 1) * bs])

    def acquire_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks every cached block of its longest cached prefix
        (never its last token: it must be computed to have logits); marks those tokens
        computed and returns how many there are."""
        if self.prefix_cache is None or seq.block_table or seq.num_computed_tokens:
            return 0
        num_blocks = (seq.num_tokens - 1) // self.block_size
        if seq.max_cached_tokens is not None:
            num_blocks = min(num_blocks, seq.max_cached_tokens // self.block_size)
        if num_blocks <= 0:
            return 0
        cache = self.prefix_cache
        seq.block_keys = []
        for i in range(num_blocks):
            key = self._key(seq, i)
            block_id = cache.block_of.get(key)
            if block_id is None:
                break
            self.device.acquire(block_id)
            seq.block_table.append(block_id)
            seq.block_keys.append(key)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.num_prefix_hit_blocks += len(seq.block_table)
        return seq.num_computed_tokens

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody references (they go back to the free list);
        blocks in use stay. Returns how many were dropped."""
        if self.prefix_cache is None:
            return 0
        dropped = 0
        while self.prefix_cache.evictable:
            self.device.free_ids.append(self.prefix_cache.evict())
            dropped += 1
        return dropped

    def release_prefix(self, seq: Sequence) -> None:
        """Undo `acquire_prefix` for a sequence that was not admitted after all."""
        self.num_prefix_hit_blocks -= len(seq.block_table)
        self.free(seq)
        seq.num_computed_tokens = 0

    def commit(self, seq: Sequence) -> None:
        """Publish `seq`'s newly computed full blocks in the prefix cache."""
        if self.prefix_cache is None or not seq.shares_cache:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_keys), num_full):
            key = self._key(seq, i)
            seq.block_keys.append(key)
            # NOTE: when another block already holds this prefix, this one stays private
            self.prefix_cache.register(key, seq.block_table[i])

    def num_freeable_blocks(self, seq: Sequence) -> int:
        """Device blocks that preempting `seq` gives back (shared ones stay with the others)."""
        return sum(1 for b in seq.block_table if self.device.ref_counts[b] == 1)

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
        seq.block_keys = []
        self.host.free(seq.host_block_table)
        seq.host_block_table = []

    # ---- fork (beam search) --------------------------------------------------------------------
    def can_fork(self, parent: Sequence) -> bool:
        """Whether a child of `parent` can get its KV now: a free block for the copy of the
        parent's partial last block, if it has one."""
        return self.device.num_free >= (1 if parent.num_computed_tokens % self.block_size else 0)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (no blocks yet) the parent's computed KV: the full blocks by reference,
        a new block for the partial last one. Returns (src, dst) of that block, whose contents
        must be copied before the child's next step, or None when there is no partial block."""
        num_computed = parent.num_computed_tokens
        num_full, partial = divmod(num_computed, self.block_size)
        for block_id in parent.block_table[:num_full]:
            self.device.acquire(block_id)
        child.block_table = parent.block_table[:num_full]
        child.block_keys = parent.block_keys[:num_full]
        child.num_computed_tokens = num_computed
        if not partial:
            return None
        (dst,) = self.device.allocate(1)
        child.block_table.append(dst)
        return parent.block_table[num_full], dst

    # ---- swap --------------------------------------------------------------------------------
    def num_cached_blocks(self, seq: Sequence) -> int:
        """Device blocks that hold computed KV (the rest of the table has no data yet)."""
        return min(len(seq.block_table), -(-seq.num_computed_tokens // self.block_size))

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_cached_blocks(seq) <= self.host.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move `seq`'s cached blocks to the host pool; returns (device_id, host_id) pairs.

        NOTE: the device blocks are free again at once. The CacheEngine copies them out before
        the step's forward writes anything, so a block reused in the same step is safe. Blocks
        shared through the prefix cache are copied too (the host copy is private to `seq`);
        only the reference of `seq` is dropped, the other holders keep them.
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
        if self.prefix_cache is not None:  # publish the full blocks again where nobody has
            for key, block_id in zip(seq.block_keys, device_ids):
                self.prefix_cache.register(key, block_id)
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
