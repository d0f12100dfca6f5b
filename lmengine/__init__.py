"""lmengine: a research inference engine for LLMs on PyTorch and transformers.

The public names load lazily, so that `lmengine.scheduler` (pure Python) imports without torch.
"""

from __future__ import annotations

import importlib

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
