"""The compiled CPU kernels (lmengine/kernels/csrc/*.cpp, one module), built once on first use.

`load()` returns the module, or None when it cannot be built (no C++ compiler, a torch without
headers) or `LMENGINE_CPU_EXT=0`: callers then use their PyTorch path. The build goes to the
lmengine cache, in a folder named by a hash of the source and the compiler flags, so an edit
rebuilds and a finished build is imported directly without running the compiler again.
`scripts/setup.sh` builds it ahead, so the first engine does not wait.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

_CSRC = Path(__file__).resolve().parent / "csrc"
# cpu_ops.cpp holds the bindings
_SOURCES = [
    _CSRC / name
    for name in (
        "cpu_ops.cpp",
        "w8a8_ops.cpp",
        "lora_ops.cpp",
        "rotary_ops.cpp",
        "gemv_ops.cpp",
        "layer_ops.cpp",
        "gguf_ops.cpp",
        "sgemm_packed_ops.cpp",
        "prefill_attention_ops.cpp",
        "bf16_ops.cpp",
        "decode_loop_ops.cpp",
        "moe_ops.cpp",
    )
]
# included by the sources: part of the build's hash
_HEADERS = [
    _CSRC / name
    for name in (
        "vec_math.h",
        "mkl_cblas.h",
        "bindings.h",
        "bf16_rows.h",
        "brgemm_tiles.h",
        "paged_cache.h",
    )
]
# NOTE: -fno-trapping-math: without it GCC does not if-convert the clamps and the final select
# of exp_approx (a float multiply it would have to speculate "could trap"), so every
# `#pragma omp simd` loop calling it stayed scalar (silu 6x, decode attention ~20 % slower).
# The results are the same; only floating-point exception flags lose their meaning.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
_KEEP_BUILDS = 3  # older builds besides the current one that stay in the cache
_lock = threading.Lock()
_module: ModuleType | None = None
_done = False  # the build was tried and finished (or failed): `_module` is final
logger = logging.getLogger(__name__)


def is_enabled() -> bool:
    return os.environ.get("LMENGINE_CPU_EXT", "1") != "0"


def _import_built(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None  # NOTE: never None when a loader is given
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build() -> ModuleType:
    import torch  # noqa: F401 - the extension links against the loaded torch libraries
    from torch.utils.cpp_extension import load as build

    sources = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    # NOTE: -march=native: a build is for this CPU only; a cache shared with another machine
    # (a copied home, a network file system) must not hand it to a CPU that lacks its ISA
    digest = hashlib.sha256(sources + " ".join(_CFLAGS).encode() + _cpu_flags()).hexdigest()[:16]
    name = f"lmengine_cpu_ops_{digest}"
    root = Path(os.environ.get("LMENGINE_CACHE", Path.home() / ".cache" / "lmengine"))
    build_dir = root / "cpu_ext" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    built = build_dir / f"{name}.so"
    # NOTE: an flock dies with its process, so a build killed half-way (a timeout, Ctrl-C)
    # cannot leave the next process waiting forever, as torch's own lock file would.
    with open(build_dir / "build.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if built.exists():
            return _import_built(name, built)
        (build_dir / "lock").unlink(missing_ok=True)  # a torch lock left by a killed build
        module = build(
            name=name,
            sources=[str(path) for path in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    _prune_old_builds(build_dir)
    return module


def _cpu_flags() -> bytes:
    """The instruction-set flags of this CPU (Linux), b"" where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[-1].strip().encode()
    except OSError:
        pass
    return b""


def _prune_old_builds(current: Path, keep: int = _KEEP_BUILDS) -> None:
    """Delete all but the `keep` most recent other builds (every source edit makes a new
    folder). A folder whose build lock another process holds is left alone; a process that
    already imported a deleted build keeps working (the file stays open)."""
    others = [d for d in current.parent.iterdir() if d.is_dir() and d != current]
    others.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    for folder in others[keep:]:
        try:
            with open(folder / "build.flock", "a") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(folder)
        except OSError:  # in use, or already gone: leave it
            continue


def load() -> ModuleType | None:
    """The compiled module, or None (then use the PyTorch path). `LMENGINE_CPU_EXT=0` is read
    by the first call; tests that need the PyTorch path replace `load` itself."""
    global _module, _done
    if _done:  # NOTE: the hot path (every linear and attention call asks): no lock, no env
        return _module
    with _lock:
        if not _done and not is_enabled():
            _done = True  # _module stays None
        if not _done:
            try:
                _module = _build()
            except Exception as exc:  # noqa: BLE001 - any failure means: use the torch path
                logger.warning("lmengine CPU kernels unavailable, using PyTorch paths: %s", exc)
            _done = True
        return _module
