"""The compiled CPU kernels (lmengine/kernels/csrc/cpu_ops.cpp), built once on first use.

`load()` compiles the C++ source with torch.utils.cpp_extension into the lmengine cache (keyed
by a hash of the source, so an edit rebuilds) and returns the module, or None when it cannot be
built (no C++ compiler, a torch without headers) or `LMENGINE_CPU_EXT=0`: callers then use their
PyTorch path. `scripts/setup.sh` builds it ahead, so the first engine does not wait.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_ops.cpp"
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
logger = logging.getLogger(__name__)


def is_enabled() -> bool:
    return os.environ.get("LMENGINE_CPU_EXT", "1") != "0"


def _build_dir(digest: str) -> Path:
    root = Path(os.environ.get("LMENGINE_CACHE", Path.home() / ".cache" / "lmengine"))
    path = root / "cpu_ext" / digest
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> ModuleType | None:
    """The compiled module, or None (then use the PyTorch path)."""
    global _module, _tried
    if not is_enabled():
        return None
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            from torch.utils.cpp_extension import load as build

            digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
            _module = build(
                name=f"lmengine_cpu_ops_{digest}",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_dir(digest)),
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
            logger.warning("lmengine CPU kernels unavailable, using PyTorch paths: %s", exc)
            _module = None
        return _module
