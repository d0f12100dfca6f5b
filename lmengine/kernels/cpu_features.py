"""What the CPU computes on its matrix units, read once from /proc/cpuinfo.

bfloat16 runs on AMX tiles (Intel Sapphire Rapids and later: `amx_bf16`) or on AVX512-BF16
dot products (Intel Cooper Lake and later, AMD Zen 4 and later: `avx512_bf16`); int8 on AMX
(`amx_int8`) or VNNI (`avx512_vnni`, `avx_vnni`). Elsewhere (AVX2-only CPUs, Zen 3) bfloat16
is emulated in float32 and is slower than float32 itself, so `dtype="auto"` keeps float32
there (lmengine/engine/loader.py). Tests mock `cpu_flags`.
"""

from __future__ import annotations

import functools

from lmengine.kernels import cpu_ext

BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
INT8_FLAGS = frozenset({"amx_int8", "avx512_vnni", "avx_vnni"})


@functools.cache
def _read_flags() -> frozenset[str]:
    # NOTE: the line the kernel build hashes (cpu_ext), read once
    return frozenset(cpu_ext._cpu_flags().decode(errors="replace").split())


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (Linux), empty where unknown."""
    return _read_flags()


def has_bf16_units() -> bool:
    """Whether bfloat16 GEMMs run natively (AMX-BF16 or AVX512-BF16)."""
    return bool(cpu_flags() & BF16_FLAGS)


def has_int8_units() -> bool:
    """Whether int8 dot products run natively (AMX-INT8 or VNNI)."""
    return bool(cpu_flags() & INT8_FLAGS)


def describe() -> str:
    """One line for logs and the CLI: which units the CPU has."""
    units = sorted(cpu_flags() & (BF16_FLAGS | INT8_FLAGS))
    return ", ".join(units) if units else "no bfloat16 / int8 matrix units"
