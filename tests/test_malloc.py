"""engine/malloc.py: once set, a large tensor freed and allocated again step after step stops
faulting its pages in; an engine idle for `IDLE_RELEASE_S` hands that kept memory back; the
GEMMs oneDNN compiles for each row count stay within the caches' bound lmengine sets.
engine/collector.py: while an engine lives, what was alive when it was built is out of the
collector's scans; once the last engine closes, cyclic garbage of that time is freed."""

from __future__ import annotations

import os
import sys

import pytest

from tests.engine_utils import run_probe

_PROBE = """
import json, resource, threading, torch
from lmengine.engine.malloc import keep_freed_memory

def faults(warm=20, cycles=10):
    out = {}
    def run():  # on a thread, as the engine loop runs its steps
        for i in range(warm + cycles):
            if i == warm:
                before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t = torch.empty(50 << 18)  # 50 MiB, a 4,096-token step's MLP output
            t.fill_(1.0)
            del t
        out["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["faults"]

before = faults()
applied = keep_freed_memory()
print(json.dumps({"before": before, "applied": applied, "after": faults()}))
"""
_PAGES_PER_CYCLE = (50 << 20) // os.sysconf("SC_PAGE_SIZE")


def _probe(env: dict, probe: str = _PROBE, *args: str) -> dict:
    return run_probe(probe, *args, env=env)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_freed_tensors_are_reused_without_faults():
    res = _probe({})
    assert res["applied"]
    # glibc's default: every cycle faults (half of, here) its pages in
    assert res["before"] > 10 * _PAGES_PER_CYCLE / 4, res
    assert res["after"] < _PAGES_PER_CYCLE / 10, res  # settled: the block is reused


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_the_setting_can_be_left_alone():
    res = _probe({"LMENGINE_KEEP_FREED_MEMORY": "0"})
    assert not res["applied"]
    assert res["after"] > 10 * _PAGES_PER_CYCLE / 4, res


_PAD_PROBE = """
import json, threading, torch
from lmengine.engine.malloc import keep_freed_memory

applied = keep_freed_memory()
out = {}

def run():  # a new thread: glibc gives it an arena of its own, grown in heaps of 64 MiB
    t = torch.empty(1 << 18)  # 1 MiB
    at = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= at < hi:
                out["usable_mb"] = (hi - lo) / (1 << 20) if perms.startswith("rw") else 0

thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps({"applied": applied, **out}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_a_threads_heap_is_made_whole_at_once():
    # the top pad: a thread's heap is opened at its full 64 MiB when first made, and is not
    # unmapped when a step's last block in it is freed (so it is not faulted in again)
    res = _probe({}, _PAD_PROBE)
    assert res["applied"] and res["usable_mb"] > 60, res
    res = _probe({"LMENGINE_KEEP_FREED_MEMORY": "0"}, _PAD_PROBE)
    assert not res["applied"] and res["usable_mb"] < 8, res


_IDLE_PROBE = """
import json, sys, time, torch
from lmengine.engine import engine as engine_module
from lmengine import Engine, EngineConfig, GenerationConfig

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

engine_module.IDLE_RELEASE_S = 1.0
eng = Engine.from_pretrained(sys.argv[1], EngineConfig(num_gpu_blocks=64))
inst = eng.create_instance()
inst.infer(0, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=2))  # warm-up
time.sleep(1.5)
out = {}

pinned = []

def big_step():  # on the loop thread: a step's activations, freed (and kept by malloc)
    step = [torch.ones(6 << 18) for _ in range(8)]  # 48 MiB
    pinned.append(torch.ones(64))  # allocated after them, it lives on, as a step's outputs do
    del step

for name in ("first", "second"):  # the second idle period releases again
    before = rss_mb()
    eng.call(big_step)
    inst.infer(0, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=2))  # a step
    busy = rss_mb()
    time.sleep(0.3)
    soon = rss_mb()  # idle for less than IDLE_RELEASE_S: still kept
    time.sleep(1.5)
    out[name] = {"before": before, "busy": busy, "soon": soon, "idle": rss_mb()}
eng.close()
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_an_idle_engine_hands_its_freed_memory_back(tiny_llama_path):
    res = _probe({}, _IDLE_PROBE, tiny_llama_path)
    for period in res.values():
        assert period["busy"] - period["before"] > 35, res  # 48 MiB freed and kept
        assert period["soon"] - period["before"] > 35, res
        assert period["idle"] - period["before"] < 15, res  # handed back


_GEMM_PROBE = """
import json, torch
from lmengine.engine.malloc import keep_freed_memory, release_idle_memory
from lmengine.kernels.linear import can_pack, linear, pack_weight

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

keep_freed_memory()
torch.manual_seed(0)
weights = [torch.randn(o, i) for o, i in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
packs = [pack_weight(w) for w in weights]
before = rss_mb()
for rows in range(9, 409):  # 1,600 (shape, row count) GEMMs: steps come in all sizes
    for w, p in zip(weights, packs):
        linear(torch.randn(rows, w.shape[1]), w, None, p)
release_idle_memory()
print(json.dumps({"packed": can_pack(weights[0]) and packs[0].dtype == torch.float32,
                  "growth_mb": rss_mb() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_compiled_gemms_stay_within_the_cache_bound():
    onednn = {"LMENGINE_GEMM": "onednn"}  # Intel CPUs take MKL's packed GEMM otherwise
    capped = _probe(onednn, _GEMM_PROBE)
    if not capped["packed"]:
        pytest.skip("no oneDNN packing here")
    # as the libraries come (an operator's setting wins over lmengine's): 1,024 of each kept
    limits = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}
    uncapped = _probe({**onednn, **limits}, _GEMM_PROBE)
    assert capped["growth_mb"] < 260, (capped, uncapped)  # 512 GEMMs of ~0.35 MB, 16 wrappers
    assert uncapped["growth_mb"] - capped["growth_mb"] > 150, (capped, uncapped)


_FREEZE_PROBE = """
import gc, json, sys, weakref
from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine import collector

class Node:
    pass

cycle = Node()
cycle.me = cycle  # cyclic: only the collector frees it
dead = weakref.ref(cycle)
eng = Engine.from_pretrained(sys.argv[1], EngineConfig(num_gpu_blocks=32))
out = {"frozen": gc.get_freeze_count(), "engines": collector.num_engines()}
eng.create_instance().infer(1, [1, 2, 3], gen_config=GenerationConfig(max_new_tokens=2))
del cycle
gc.collect()
out["freed_while_frozen"] = dead() is None  # frozen: never scanned, so never freed
second = Engine.from_pretrained(sys.argv[1], EngineConfig(num_gpu_blocks=32))
eng.close()
out["frozen_beside_second"] = gc.get_freeze_count()
second.close()
gc.collect()
out.update(after=gc.get_freeze_count(), freed_after=dead() is None, left=collector.num_engines())
print(json.dumps(out))
"""


def test_an_engine_freezes_the_loaded_heap_until_the_last_one_closes(tiny_llama_path):
    res = _probe({}, _FREEZE_PROBE, tiny_llama_path)
    assert res["engines"] == 1 and res["frozen"] > 10_000, res  # torch's, transformers', ...
    assert not res["freed_while_frozen"], res
    assert res["frozen_beside_second"] > 10_000, res  # the second engine keeps it frozen
    assert res["after"] == 0 and res["freed_after"] and res["left"] == 0, res
