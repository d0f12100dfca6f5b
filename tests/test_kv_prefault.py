"""EngineConfig.prefault_kv_cache: a CPU KV pool built with `prefault` has its memory mapped
(resident) once it exists, without it only once blocks are written; either way it reads as
zeros, for every cache layout (plain, int8 with scales, latent). The pool is memory of its
own, never a heap's freed memory (which would be zeroed page by page when it is built)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.engine_utils import run_probe

# NOTE: a fresh process, so the pool is a fresh mapping whose resident size is its own
_PROBE = """
import json, sys, torch
from lmengine.engine.cache_engine import CacheEngine, CacheSpec

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024

kv, latent, prefault = sys.argv[1], sys.argv[2] == "latent", sys.argv[3] == "1"
freed = []  # address ranges of memory the process freed and kept (as an engine does)
if sys.argv[4] == "1":
    from lmengine.engine.malloc import keep_freed_memory

    keep_freed_memory()
    junk = [torch.ones(1 << 24) for _ in range(8)]
    freed = [(t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in junk]
    del junk
spec = CacheSpec(4, 4, 64, 16, torch.bfloat16, kv, 32 if latent else None)
blocks = (256 << 20) // spec.block_bytes
before = rss()
cache = CacheEngine(spec, blocks, 0, torch.device("cpu"), prefault=prefault)
grown = rss() - before
tensors = [t for layer in cache.kv_caches for t in layer]
zeros = all(not t.any() for t in tensors)
reused = any(lo <= t.data_ptr() < hi for t in tensors for lo, hi in freed)
vmas = []  # (start, end, VmFlags) of each mapping of the process
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            vmas.append([lo, hi, []])
        elif head == "VmFlags:":
            vmas[-1][2] = line.split()[1:]
huge = [any(lo <= t.data_ptr() < hi and "hg" in flags for lo, hi, flags in vmas)
        for t in tensors]
print(json.dumps({"pool": blocks * spec.block_bytes, "grown": grown, "zeros": zeros,
                  "reused": reused, "huge": huge}))
"""


def _pool(kv: str, layout: str, prefault: bool, after_free: bool = False) -> dict:
    return run_probe(_PROBE, kv, layout, "1" if prefault else "0", "1" if after_free else "0")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kv,layout", [("auto", "plain"), ("int8", "plain"), ("auto", "latent")])
def test_a_prefaulted_pool_is_resident_from_the_start(kv, layout):
    mapped = _pool(kv, layout, prefault=True)
    assert mapped["zeros"]
    assert mapped["grown"] > 0.95 * mapped["pool"], mapped
    lazy = _pool(kv, layout, prefault=False)
    assert lazy["zeros"]
    assert lazy["grown"] < 0.1 * lazy["pool"], lazy


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="a kernel without transparent huge pages",
)
def test_a_prefaulted_pool_asks_for_huge_pages_and_a_lazy_one_does_not():
    """A pool mapped at start is in huge pages (madvise: one TLB entry per 2 MB of the blocks
    a step reaches); one mapped as blocks are first written stays in 4 KiB pages, each first
    write faulting in 4 KiB, not a zeroed 2 MB."""
    assert all(_pool("auto", "plain", prefault=True)["huge"])
    assert not any(_pool("auto", "plain", prefault=False)["huge"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heaps")
def test_the_pool_is_not_made_of_memory_the_process_freed():
    """Built after the process freed memory its heap keeps: still zeros, and in none of it
    (calloc took it from there and zeroed it page by page)."""
    pool = _pool("auto", "plain", prefault=False, after_free=True)
    assert pool["zeros"] and not pool["reused"], pool
