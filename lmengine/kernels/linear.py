"""Linear layers on CPU: a weight-streaming GEMV for a few rows, oneDNN on weights pre-packed
once for mid-sized batches, and for large prefills MKL (`F.linear`) on Intel, oneDNN elsewhere.

Measured on the 2-core Intel Xeon of sessions 1-6, float32, weights streamed from memory as in
a real forward (all of SmolLM2-135M's linears, best of interleaved runs):
- 1 to 8 rows (single-stream decode, small batches, speculative verification): the compiled
  `gemv` (kernels/csrc/gemv_ops.cpp) streams the weights at ~16-17 GB/s, against ~13-15 GB/s
  for MKL's GEMV at one row and ~9-12 GB/s for oneDNN at 2-8 rows: 13 % faster than MKL at one
  row, 25-45 % faster than oneDNN at 2-8. On an AMD EPYC Zen 3 (AVX2, session 10), after one
  row took four accumulators per step: 16-20 GB/s against MKL's 9-11 GB/s (the old two-
  accumulator loop 13-15 GB/s).
- 9 to ~1k rows: oneDNN on pre-packed weights runs the GEMMs of a 64-token decode step 1.5x
  faster than MKL and those of a 16-token step 3x faster.
- from ~1k rows (large prefills) MKL wins again on Intel CPUs, so those keep using it there.
On other x86 CPUs MKL takes a generic code path: on an AMD EPYC (Zen 5, AVX-512) its GEMMs
ran at 150-195 GFLOP/s against oneDNN's 340-475 from 64 to 4,096 rows, so oneDNN serves
every size from 9 rows up (`mkl_wins_large_gemms`).
Elsewhere (CUDA, other dtypes, a torch without oneDNN or without the compiled kernels)
`linear` is `F.linear`, which is also the reference.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext

_PACK_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows
_MAX_GEMV_ROWS = 8  # up to this many rows the compiled weight-streaming GEMV is fastest
_MAX_ROWS_FOR_PACKED = 1023  # from ~1k rows (large prefills) MKL is faster again


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of `weight` [out, in], or None where packing does not apply."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [num_tokens, in] -> [num_tokens, out]; `packed` from `pack_weight(weight)`.

    `packed` also marks a weight as a CPU float32 matrix the fast paths may take."""
    rows = x.shape[0]
    if packed is None or rows == 0:  # 0 rows: a chunk's lm_head
        return F.linear(x, weight, bias)
    if rows > _MAX_ROWS_FOR_PACKED and mkl_wins_large_gemms():
        return F.linear(x, weight, bias)
    if rows <= _MAX_GEMV_ROWS:
        gemv = _gemv_kernel()
        if gemv is not None and x.shape[1] % 16 == 0 and weight.is_contiguous():
            return gemv(x.contiguous(), weight, bias)
        if rows == 1 and mkl_wins_large_gemms():  # MKL's GEMV beats oneDNN at one row
            return F.linear(x, weight, bias)
    return _onednn(x, packed, bias)


def _gemv_kernel():
    """The compiled weight-streaming GEMV, or None (then MKL / oneDNN)."""
    module = cpu_ext.load()
    return None if module is None else module.gemv


@functools.cache
def mkl_wins_large_gemms() -> bool:
    """True on Intel CPUs, where MKL beats oneDNN on GEMMs of ~1k rows and more (and on one
    row without the compiled GEMV); elsewhere MKL does not take its fast code paths.
    `LMENGINE_LARGE_GEMM=mkl|onednn` overrides."""
    choice = os.environ.get("LMENGINE_LARGE_GEMM", "").lower()
    if choice in ("mkl", "onednn"):
        return choice == "mkl"
    try:
        return is_intel_cpu(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return True  # unknown: keep torch's default


def is_intel_cpu(cpuinfo: str) -> bool:
    """From /proc/cpuinfo text: every vendor_id is GenuineIntel (or none is listed)."""
    vendors = {
        line.split(":", 1)[1].strip()
        for line in cpuinfo.splitlines()
        if line.startswith("vendor_id") and ":" in line
    }
    return vendors <= {"GenuineIntel"}


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
