"""engine/malloc.py: once set, a large tensor freed and allocated again step after step stops
faulting its pages in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


def _probe(env: dict) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


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
