"""EngineConfig.prefault_kv_cache: a CPU KV pool built with `prefault` has its memory mapped
(resident) once it exists, without it only once blocks are written; either way it reads as
zeros, for every cache layout (plain, int8 with scales, latent)."""

from __future__ import annotations

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
spec = CacheSpec(4, 4, 64, 16, torch.bfloat16, kv, 32 if latent else None)
blocks = (256 << 20) // spec.block_bytes
before = rss()
cache = CacheEngine(spec, blocks, 0, torch.device("cpu"), prefault=prefault)
grown = rss() - before
zeros = all(not t.any() for layer in cache.kv_caches for t in layer)
print(json.dumps({"pool": blocks * spec.block_bytes, "grown": grown, "zeros": zeros}))
"""


def _pool(kv: str, layout: str, prefault: bool) -> dict:
    return run_probe(_PROBE, kv, layout, "1" if prefault else "0")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kv,layout", [("auto", "plain"), ("int8", "plain"), ("auto", "latent")])
def test_a_prefaulted_pool_is_resident_from_the_start(kv, layout):
    mapped = _pool(kv, layout, prefault=True)
    assert mapped["zeros"]
    assert mapped["grown"] > 0.95 * mapped["pool"], mapped
    lazy = _pool(kv, layout, prefault=False)
    assert lazy["zeros"]
    assert lazy["grown"] < 0.1 * lazy["pool"], lazy
