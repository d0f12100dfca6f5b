"""LoRA adapter residency: names, ids, pages of the device pool, reference counts. Pure Python.

The device pool (S-LoRA unified paging) has, for each kind of LoRA-able linear (a module
path inside a decoder layer, e.g. `self_attn.qkv_proj`), a fixed number of pages; a page is
one rank-row of one adapter in every layer. An adapter needs `demand[kind]` pages of each kind
it targets (the sum of its ranks over the parts of that linear), taken anywhere in the pool,
so adapters of different ranks and targets pack without waste.

The Scheduler `acquire`s a sequence's adapter when it admits it: a resident adapter just
gains a reference; a cold one gets pages, evicting least recently used idle adapters, and is
queued for loading. A sequence `release`s its adapter when it ends. The ModelAgent copies
weights into the pages; this class never touches tensors.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from lmengine.scheduler.sequence import Sequence


@dataclass
class AdapterLoad:
    """Copy adapter `adapter_id`'s host weights into these pages before the step runs."""

    adapter_id: int
    pages: dict[str, list[int]]  # kind -> page ids, in the adapter's rank order


@dataclass(eq=False)
class _Adapter:
    adapter_id: int
    name: str
    demand: dict[str, int]  # kind -> pages needed
    pages: dict[str, list[int]] | None = None  # None while not resident
    ref_count: int = 0  # sequences holding it
    last_used: int = 0
    is_removed: bool = False  # removed by name; freed when its last sequence ends


@dataclass
class AdapterPlan:
    """The adapter part of one SchedulerOutput."""

    loads: list[AdapterLoad] = field(default_factory=list)
    page_tables: dict[int, dict[str, list[int]]] = field(default_factory=dict)  # scheduled ones
    drops: list[int] = field(default_factory=list)  # ids whose host weights can go


class AdapterManager:
    """Owns adapter names -> ids and the page free lists of the LoRA pool.

    `capacity` is the number of pages of each kind. Never touches tensors; the engine loop
    thread is its only caller.
    """

    def __init__(self, capacity: dict[str, int]) -> None:
        self.capacity = dict(capacity)
        self.free_pages: dict[str, deque[int]] = {k: deque(range(n)) for k, n in capacity.items()}
        self.adapters: dict[int, _Adapter] = {}  # live ids, removed-but-busy included
        self.ids: dict[str, int] = {}  # name -> id of registered adapters
        self.names: frozenset[str] = frozenset()  # the same names, swapped whole: any thread
        self._holders: dict[int, int] = {}  # seq_id -> adapter_id it holds
        self._next_id = itertools.count()
        self._clock = itertools.count(1)
        self._pending_loads: list[AdapterLoad] = []
        self._pending_drops: list[int] = []
        self.num_loads = 0
        self.num_evictions = 0

    # ---- registry -----------------------------------------------------------------------------
    def register(self, name: str, demand: dict[str, int]) -> int:
        """Add an adapter by name; returns its id. Raises ValueError when the name is taken or
        the adapter can never fit the pool."""
        if name in self.ids:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        for kind, num in demand.items():
            if kind not in self.capacity:
                raise ValueError(f"adapter {name!r}: no LoRA pool for {kind!r}")
            if num > self.capacity[kind]:
                raise ValueError(
                    f"adapter {name!r} needs {num} pages of {kind} but the LoRA pool has "
                    f"{self.capacity[kind]}: raise max_lora_slots or max_lora_rank"
                )
        adapter = _Adapter(next(self._next_id), name, {k: n for k, n in demand.items() if n})
        self.adapters[adapter.adapter_id] = adapter
        self.ids[name] = adapter.adapter_id
        self.names = frozenset(self.ids)
        return adapter.adapter_id

    def remove(self, name: str) -> int:
        """Unregister `name`: new requests cannot use it; running ones finish with it."""
        if name not in self.ids:
            raise ValueError(f"unknown adapter {name!r}")
        adapter = self.adapters[self.ids.pop(name)]
        self.names = frozenset(self.ids)
        adapter.is_removed = True
        if adapter.ref_count == 0:
            self._forget(adapter)
        return adapter.adapter_id

    def id_of(self, name: str) -> int | None:
        return self.ids.get(name)

    def _forget(self, adapter: _Adapter) -> None:
        self._evict(adapter)
        del self.adapters[adapter.adapter_id]
        self._pending_drops.append(adapter.adapter_id)

    # ---- residency ----------------------------------------------------------------------------
    def acquire(self, seq: Sequence) -> bool:
        """Give `seq` a reference to its adapter, making it resident if needed. False when the
        pool cannot hold it now (every other resident adapter is busy): admit `seq` later."""
        adapter_id = seq.adapter_id
        if adapter_id is None or seq.seq_id in self._holders:
            return True
        adapter = self.adapters[adapter_id]
        if adapter.pages is None and not self._make_resident(adapter):
            return False
        adapter.ref_count += 1
        adapter.last_used = next(self._clock)
        self._holders[seq.seq_id] = adapter_id
        return True

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s reference (idempotent). The adapter stays resident, evictable."""
        adapter_id = self._holders.pop(seq.seq_id, None)
        if adapter_id is None:
            return
        adapter = self.adapters[adapter_id]
        adapter.ref_count -= 1
        adapter.last_used = next(self._clock)
        if adapter.is_removed and adapter.ref_count == 0:
            self._forget(adapter)

    def _make_resident(self, adapter: _Adapter) -> bool:
        idle = sorted(
            (a for a in self.adapters.values() if a.pages is not None and a.ref_count == 0),
            key=lambda a: a.last_used,
        )
        reclaimable = {k: len(self.free_pages[k]) for k in adapter.demand}
        for a in idle:
            for k in reclaimable:
                reclaimable[k] += len(a.pages.get(k, ()))
        if any(reclaimable[k] < n for k, n in adapter.demand.items()):
            return False
        for victim in idle:  # least recently used first, only as many as needed
            if all(len(self.free_pages[k]) >= n for k, n in adapter.demand.items()):
                break
            if any(victim.pages.get(k) for k in adapter.demand):
                self._evict(victim)
                self.num_evictions += 1
        adapter.pages = {
            k: [self.free_pages[k].popleft() for _ in range(n)] for k, n in adapter.demand.items()
        }
        self._pending_loads.append(AdapterLoad(adapter.adapter_id, adapter.pages))
        self.num_loads += 1
        return True

    def _evict(self, adapter: _Adapter) -> None:
        if adapter.pages is None:
            return
        for kind, pages in adapter.pages.items():
            self.free_pages[kind].extend(pages)
        adapter.pages = None
        # NOTE: a load queued in this same schedule call must not write freed pages
        pending = self._pending_loads
        self._pending_loads = [ld for ld in pending if ld.adapter_id != adapter.adapter_id]

    def plan(self, adapter_ids: Iterable[int | None]) -> AdapterPlan:
        """Loads and drops queued since the last plan, and the page tables of `adapter_ids`
        (the adapters of the step's scheduled sequences)."""
        tables = {}
        for i in adapter_ids:
            if i is not None and i not in tables:
                pages = self.adapters[i].pages
                assert pages is not None, f"adapter {i} is scheduled but not resident"
                tables[i] = pages
        plan = AdapterPlan(self._pending_loads, tables, self._pending_drops)
        self._pending_loads, self._pending_drops = [], []
        return plan

    # ---- observability ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        resident = [a for a in self.adapters.values() if a.pages is not None]
        return {
            "num_adapters": len(self.ids),
            "num_resident_adapters": len(resident),
            "num_active_adapters": sum(a.ref_count > 0 for a in self.adapters.values()),
            "num_lora_pages": sum(self.capacity.values()),
            "num_free_lora_pages": sum(len(f) for f in self.free_pages.values()),
            "num_adapter_loads": self.num_loads,
            "num_adapter_evictions": self.num_evictions,
        }

    def check_integrity(self, sequences: Iterable[Sequence] | None = None) -> None:
        """Assert that pages and references add up (and match `sequences`, the live ones)."""
        for kind, num in self.capacity.items():
            owned = [p for a in self.adapters.values() if a.pages for p in a.pages.get(kind, ())]
            free = list(self.free_pages[kind])
            assert len(set(owned + free)) == len(owned) + len(free) == num, f"{kind}: pages lost"
        for a in self.adapters.values():
            held = sum(1 for i in self._holders.values() if i == a.adapter_id)
            assert a.ref_count == held, f"adapter {a.name}: ref_count {a.ref_count} != {held}"
            assert a.ref_count == 0 or a.pages is not None, f"adapter {a.name}: busy, not resident"
        if sequences is not None:
            live = {s.seq_id: s.adapter_id for s in sequences}
            for seq_id, adapter_id in self._holders.items():
                assert live.get(seq_id) == adapter_id, f"sequence {seq_id} holds a stale adapter"
