"""lmengine: a research inference engine for LLMs on PyTorch and transformers."""

from __future__ import annotations

from lmengine.config import EngineConfig, GenerationConfig
from lmengine.engine.engine import Engine
from lmengine.engine.instance import EngineInstance
from lmengine.engine.request import Response
from lmengine.pipeline import Pipeline, pipeline

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineInstance",
    "GenerationConfig",
    "Pipeline",
    "Response",
    "pipeline",
]
