"""lmengine: a research inference engine for LLMs on PyTorch and transformers.

The public names load lazily, so that `lmengine.scheduler` (pure Python) imports without torch.
"""

from __future__ import annotations

import importlib
import os

# oneDNN keeps every GEMM it compiled (one per weight shape and row count, ~0.35 MB each) in a
# cache of 1,024; PyTorch's ideep keeps its own wrapper of each (~0.1 MB) in another. A
# server's steps come in every row count, and RSS grew with them through a 30-minute soak.
# Measured on an AMD EPYC Zen 3 (2 cores, 2026-11-28), SmolLM2's linears over 900-1,200 steps
# of serving-like row counts, rows/s and RSS growth: a working set of ~500 GEMMs (9-64 decode
# rows, a quarter of the steps with a 100-token prompt more) 2,477 rows/s and +289 MB as the
# libraries come, 2,492 and +208 MB with 512 and 16 (ideep rebuilds its wrapper from oneDNN's
# cache at no measurable cost), 2,292 and +120 MB with 256 of each (recompiling evicted GEMMs);
# ever new row counts (up to 700 prompt tokens more) 4,967 rows/s and +488 MB still rising,
# against 5,092 and +157 MB with 512 and 16. Both libraries read these variables when first
# used, so they are set on importing lmengine (an operator's own values win);
# kernels/linear.py runs those GEMMs.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
os.environ.setdefault("LRU_CACHE_CAPACITY", "16")

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "lmengine.engine.engine",
    "EngineConfig": "lmengine.config",
    "EngineInstance": "lmengine.engine.instance",
    "GenerationConfig": "lmengine.config",
    "Pipeline": "lmengine.api",
    "RequestMetrics": "lmengine.engine.request",
    "Response": "lmengine.engine.request",
    "Score": "lmengine.api",
    "SpeculativeConfig": "lmengine.config",
    "SteeringVector": "lmengine.config",
    "pipeline": "lmengine.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lmengine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
