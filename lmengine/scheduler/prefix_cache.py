"""Content-addressed KV blocks for prefix caching. Pure Python, no tensors.

A sequence's chain starts at a salt made of its adapter's name and registration id (an id
serves one registration only), so an adapter removed and added again under the same name
never reuses the KV of the one before, and nothing is kept per removed adapter.

A full block's key chains the previous block's key, the adapter name and the block's token
ids (blake2b, 16 bytes), so equal keys mean equal prefixes under the same adapter: blocks are
never shared across adapters. The PrefixCache maps keys to device block ids and keeps the
blocks nobody references any more (reference count 0, content still valid) in an LRU order:
they count as free and are evicted, oldest first, only when the pool's free list is empty.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_key(prev: bytes | None, adapter_name: str | None, token_ids: list[int]) -> bytes:
    """Key of a full block whose tokens are `token_ids`, after the block keyed `prev`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev or b"\0" * 16)
    h.update(b"\1" + adapter_name.encode() + b"\0" if adapter_name is not None else b"\0")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class PrefixCache:
    """key <-> device block id for computed full blocks, and the LRU of unreferenced ones."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}  # key -> block id
        self.key_of: dict[int, bytes] = {}  # block id -> key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref count 0, oldest first

    @staticmethod
    def salt(adapter_name: str | None, adapter_id: int | None) -> bytes:
        """Root key of the chains computed under one registration of an adapter (the base
        model: None, None). A removed adapter's blocks are never matched again, since a later
        registration under its name has another id; they age out through the LRU."""
        return block_key(None, adapter_name, [-1 if adapter_id is None else adapter_id])

    def __len__(self) -> int:
        return len(self.block_of)

    def register(self, key: bytes, block_id: int) -> bool:
        """Publish `block_id` (referenced, fully computed) under `key`; False when `key` is
        already cached in another block or the block already has a key."""
        if key in self.block_of or block_id in self.key_of:
            return False
        self.block_of[key] = block_id
        self.key_of[block_id] = key
        return True

    def park(self, block_id: int) -> bool:
        """The last reference to `block_id` is gone: keep it as evictable if it has a key."""
        if block_id not in self.key_of:
            return False
        self.evictable[block_id] = None  # NOTE: appended last = most recently used
        return True

    def unpark(self, block_id: int) -> None:
        """A sequence references an evictable block again."""
        del self.evictable[block_id]

    def evict(self) -> int:
        """Forget the least recently used unreferenced block and return its id."""
        block_id, _ = self.evictable.popitem(last=False)
        del self.block_of[self.key_of.pop(block_id)]
        return block_id

    def check_integrity(self, ref_counts: list[int]) -> None:
        assert len(self.block_of) == len(self.key_of), "prefix cache: maps disagree"
        for key, b in self.block_of.items():
            assert self.key_of.get(b) == key, f"prefix cache: block {b} key mismatch"
        for b in self.evictable:
            assert b in self.key_of, f"prefix cache: evictable block {b} has no key"
            assert ref_counts[b] == 0, f"prefix cache: evictable block {b} is referenced"
        for b in self.key_of:
            assert ref_counts[b] > 0 or b in self.evictable, f"prefix cache: block {b} lost"
