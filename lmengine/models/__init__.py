"""Model patching: HF modules keep their weights; MODULE_MAP swaps their behaviour."""

from __future__ import annotations

from lmengine.models.module_map import MODULE_MAP, register_module
from lmengine.models.patch import patch, supported_architectures

__all__ = ["MODULE_MAP", "patch", "register_module", "supported_architectures"]
