"""`patch(model)`: swap the classes named in MODULE_MAP for their lmengine implementations."""

from __future__ import annotations

import importlib

from torch import nn

from lmengine.models.module_map import MODULE_MAP


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _import(name: str) -> type:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def supported_architectures(module_map: dict[str, str] | None = None) -> list[str]:
    """Class names of the causal-LM heads that have a patch."""
    names = [n.rpartition(".")[2] for n in (module_map or MODULE_MAP)]
    return sorted(n for n in names if n.endswith(("ForCausalLM", "LMHeadModel")))


def patch(model: nn.Module, extra_map: dict[str, str] | None = None) -> nn.Module:
    """Patch `model` in place and return it. Patched classes may define
    `lmengine_post_patch()`, called once after all swaps (to fuse or shard weights).

    Raises ValueError for an architecture without a patch: running it unpatched would
    silently ignore the paged KV cache.
    """
    module_map = {**MODULE_MAP, **(extra_map or {})}
    top = qualname(type(model))
    if top not in module_map:
        raise ValueError(
            f"architecture {type(model).__name__} has no lmengine patch; supported: "
            f"{', '.join(supported_architectures(module_map))}. To add one, write patched "
            "subclasses of its HF modules and map them with lmengine.models.register_module or "
            "EngineConfig(module_map=...): see docs/adding_a_model.md."
        )
    # the HF architecture, for code that must know it after the classes are swapped
    model.lmengine_architecture = type(model).__name__
    for module in model.modules():
        target = module_map.get(qualname(type(module)))
        if target is not None:
            cls = _import(target)
            if not issubclass(cls, type(module)):
                raise TypeError(f"{target} must subclass {qualname(type(module))}")
            module.__class__ = cls
    # NOTE: after every class is swapped, so a hook may rely on its children being patched.
    for module in model.modules():
        hook = getattr(module, "lmengine_post_patch", None)
        if hook is not None:
            hook()
    return model
