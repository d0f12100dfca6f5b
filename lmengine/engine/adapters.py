"""The engine's LoRA adapters at run time: `Engine.add_adapter`, `remove_adapter`,
`adapter_names`. The weights are read in the calling thread and registered on the loop
thread between two steps; the LoRA pool (engine/lora_pool.py) holds the tensors and the
AdapterManager (scheduler/adapter_manager.py) the names, ids and pages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmengine.config import EngineConfig
from lmengine.engine.lora_pool import DEFAULT_MAX_LORA_RANK, AdapterWeights
from lmengine.scheduler import AdapterManager, Scheduler


class LoraAdmin:
    """The adapter methods of `Engine` (a mixin: they use its config, agent and scheduler)."""

    engine_config: EngineConfig
    model_agent: Any
    scheduler: Scheduler
    call: Callable[..., Any]

    def add_adapter(self, name: str, path: str) -> None:
        """Load the peft LoRA folder `path` as adapter `name`: read and checked in the calling
        thread, registered between two steps. Raises ValueError when the name is taken or
        the adapter does not fit the base model or the LoRA pool."""
        weights = self.model_agent.lora.read(path)  # NOTE: the steps go on meanwhile
        self.call(lambda: self._add_adapters({name: weights}), timeout=None)

    def remove_adapter(self, name: str) -> None:
        """Forget adapter `name`: new requests for it fail; running ones finish with it."""
        self.call(lambda: self._remove_adapter(name))

    @property
    def adapter_names(self) -> list[str]:
        """The adapters served now (any thread)."""
        return sorted(self._served_adapters())

    def _served_adapters(self) -> frozenset[str]:
        manager = self.scheduler.adapter_manager
        return manager.names if manager is not None else frozenset()

    def _enable_lora(self, weights: dict[str, AdapterWeights]) -> None:
        cfg = self.engine_config
        if cfg.quant_policy == "w8a8":  # adapters sit in float32 on GGUF blocks
            raise ValueError(
                f"LoRA adapters are not supported together with quant_policy={cfg.quant_policy!r}"
            )
        # NOTE: sized for the configured adapters; for one added later, leave room for others
        ranks = [w.max_rank for w in weights.values()]
        rank = cfg.max_lora_rank or max(ranks if cfg.adapters else [*ranks, DEFAULT_MAX_LORA_RANK])
        capacity = self.model_agent.lora.enable(cfg.max_lora_slots, rank, cfg.max_cpu_loras)
        self.scheduler.adapter_manager = AdapterManager(capacity)
        self._register_adapters(weights)

    def _add_adapters(self, weights: dict[str, AdapterWeights]) -> None:
        if self.scheduler.adapter_manager is None:
            self._enable_lora(weights)
        else:
            self._register_adapters(weights)

    def _register_adapters(self, weights: dict) -> None:
        manager = self.scheduler.adapter_manager
        assert manager is not None, "LoRA is not enabled"
        for name, w in weights.items():
            self.model_agent.lora.store(manager.register(name, w.demand), w)

    def _remove_adapter(self, name: str) -> None:
        manager = self.scheduler.adapter_manager
        if manager is None or name not in manager.ids:
            raise ValueError(f"unknown adapter {name!r}")
        manager.remove(name)  # prefix caching: its id salted its blocks' keys (stale KV)
