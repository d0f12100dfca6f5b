"""Linear layers on CPU: a weight-streaming GEMV for a few rows (up to 8; 24 on CPUs without
AVX-512), and from there a GEMM on a weight packed once at load: by MKL on Intel CPUs, by
oneDNN elsewhere.

Measured on the 2-core Intel Xeon of sessions 1-6, float32, weights streamed from memory as in
a real forward (all of SmolLM2-135M's linears, best of interleaved runs):
- 1 to 8 rows (single-stream decode, small batches, speculative verification): the compiled
  `gemv` (kernels/csrc/gemv_ops.cpp) streams the weights at ~16-17 GB/s, against ~13-15 GB/s
  for MKL's GEMV at one row and ~9-12 GB/s for oneDNN at 2-8 rows: 13 % faster than MKL at one
  row, 25-45 % faster than oneDNN at 2-8. On an AMD EPYC Zen 3 (AVX2, session 10), after one
  row took four accumulators per step: 16-20 GB/s against MKL's 9-11 GB/s (the old two-
  accumulator loop 13-15 GB/s). With AVX2 alone, 2-24 rows take their own kernels sized to its
  16 registers, summing in one order at every row count: SmolLM2's linears (30 layers) at 2 / 4
  / 8 / 12 / 16 / 24 rows in 17 / 18 / 21 / 30 / 38 / 48 ms against oneDNN's 20 / 24 / 29 / 36
  / 44 / 52 (before, at 8 rows: 106 ms, the accumulators spilling), on an AMD EPYC Zen 3,
  2026-11-28.
- From 9 rows, on Intel: MKL's packed GEMM (kernels/csrc/sgemm_packed_ops.cpp) on a weight
  packed once for 512 rows. On an Intel Xeon (family 6, model 167), GFLOP/s at 17 / 32 / 64 /
  117 / 256 / 1,024 / 2,048 rows: 133 / 204 / 294 / 354 / 399 / 403 / 391, against oneDNN on
  its packed weights 125 / 177 / 225 / 278 / 350 / 387 / 388 and MKL unpacked (`F.linear`)
  99 / 165 / 236 / 285 / 326 / 384 / 390: 1.25-1.3x oneDNN at 64-117 rows (a decode batch, a
  short prompt beside running decodes).
- From 9 rows elsewhere: oneDNN on pre-packed weights. MKL takes a generic code path on other
  x86 CPUs: on an AMD EPYC (Zen 5, AVX-512) its GEMMs ran at 150-195 GFLOP/s against oneDNN's
  340-475 from 64 to 4,096 rows.
Without the compiled kernels, Intel CPUs keep oneDNN's packs up to 1,023 rows and MKL unpacked
above (where it beats oneDNN there).

bfloat16 (the CPU's default where it has AMX or AVX512-BF16): 1-3 rows take the compiled GEMV on
bfloat16 weights (csrc/bf16_ops.cpp, AVX512-BF16 dot products), 4-1,023 rows oneDNN on its packed
bfloat16 weight (AMX tiles), from 1,024 rows oneDNN's matmul on the plain weight (it reorders the
weight per call, a cost the large GEMM hides, and picks its blocking for the real row count: a
4,064-token SmolLM2 prefill step 5-12 % faster than on the weight packed for 64 rows), on rows
padded to a multiple of 64 (`padded_rows`). With two threads, at 512-2,047 rows the compiled
kernels split the rows of either between the threads, each block a single-threaded oneDNN matmul
(`bf16_linear_rows`, `bf16_onednn_linear_rows`: oneDNN's own two-thread split of some shapes there
runs at one thread's speed; SmolLM2 steps of 8 / 10 / 12 prompts 171 / 193-202 / 225 -> 138 /
179-181 / 198-206 ms). `LMENGINE_BF16_GEMM=tiles` packs the weights instead in VNNI blocks for the
compiled tile GEMM (csrc/brgemm_tiles.h: oneDNN's brgemm microkernel, the epilogue on each tile in
cache), used for 4-1,023 rows. It wins where the weights stay in cache: hot, on SmolLM2's shapes,
1.3-1.8x oneDNN packed at 64 rows and 2-4x at 4-16. Streamed from memory it does not prefetch them
as oneDNN does: cold, at 110-256 rows, it is 5-40 % slower on SmolLM2's and the 1B shape's GEMMs
(level at 32 rows, 25 % slower with K = 8,192); in a whole SmolLM2 forward on a 480 MB last-level
cache a 111-token prompt took 42 against 47 ms and a 64-row decode step was level. Measured on the
Intel Xeon (family 6, model 167, AMX), 2026-11-26 and -27. One row of the 960 x 576 q/k/v GEMV
takes 0.014 ms against 0.045 for oneDNN packed and 0.024 for the float32 GEMV.

Elsewhere (CUDA, other dtypes, a torch without oneDNN) `linear` is `F.linear`, which is also the
reference.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext

# NOTE: lmengine/__init__.py bounds the caches of compiled GEMMs (oneDNN 512, ideep 16).

_PACK_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows
# MKL's layout for this many rows is the fastest from 9 to 2,048 rows (measured: 256 and 512
# alike; 768 and 1,024 pick a layout ~1.3-1.5x slower below 1,024 rows)
_MKL_PACK_ROWS = 512
_MAX_ROWS_FOR_ONEDNN = 1023  # from ~1k rows (large prefills) MKL unpacked beats oneDNN on Intel
# bfloat16: the compiled GEMV streams the weights faster than oneDNN's AMX kernels up to 3 rows
# (1.3-3x at one row on SmolLM2's shapes); from 4 rows AMX's tiles win
_MAX_BF16_GEMV_ROWS = 3
# bfloat16: oneDNN's matmul on the plain weight from this many rows (faster than on a weight
# packed for 64 rows, and than the tile GEMM, on large prompts)
_MIN_BF16_ONEDNN_ROWS = 1024
# ... on rows padded with zeros to a multiple of this: oneDNN compiles a GEMM for every row
# count it has not seen (8-13 ms for a 2,100 x 576 x 3,072 one against 2.7 ms to run it), and
# every prompt step has a row count of its own; padded, a few dozen counts serve them all
_BF16_PLAIN_ROW_STEP = 64


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (weight.dtype != torch.bfloat16 or _onednn_bf16())
    )


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN computes bfloat16 here: it needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT,
    so an AVX2-only CPU (AMD Zen 3) that is asked for bfloat16 runs PyTorch's own linear."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A packed copy of `weight` [out, in] for `linear`, or None where packing does not apply:
    MKL's packed layout (a uint8 buffer) on Intel CPUs, oneDNN's elsewhere; for bfloat16
    oneDNN's, or the compiled tile GEMM's VNNI blocks (a 1-D tensor) under
    LMENGINE_BF16_GEMM=tiles on a build with AMX-BF16."""
    if not can_pack(weight):
        return None
    weight = weight.detach().contiguous()
    if weight.dtype == torch.bfloat16:
        module = _bf16_tiles_kernels()
        if module is not None and weight.shape[1] % 2 == 0:
            return module.bf16_vnni_pack(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    mkl = _mkl_packed_kernels()
    if mkl is not None:
        return mkl.sgemm_pack(weight, _MKL_PACK_ROWS)
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)


# How `linear` computes one call (`route`): the compiled decode loop (models/decode_loop.py)
# takes the route `linear` would take for the same call, so that both give the same bits.
PLAIN, GEMV, BF16_GEMV, MKL_PACKED, ONEDNN, BF16_TILES = range(6)


def route(
    rows: int,
    x_dtype: torch.dtype,
    in_features: int,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
) -> int:
    """The kernel `linear` runs for `rows` input rows of `x_dtype` on `weight` [out,
    in_features] and its `packed` copy (`pack_weight`).

    float32: the compiled weight-streaming GEMV up to `max_gemv_rows()` rows, then MKL's packed
    GEMM (Intel) or oneDNN on its packed weight; MKL unpacked at one row or from ~1k rows where
    MKL is fast but the weight was packed for oneDNN. bfloat16: the compiled GEMV (AVX512-BF16
    dot products, half the bytes of float32) for a few rows, oneDNN's matmul on the plain weight
    from _MIN_BF16_ONEDNN_ROWS rows, between them oneDNN on its packed weight (AMX tiles or
    AVX512-BF16) or the compiled tile GEMM on VNNI blocks (a 1-D `packed`)."""
    if packed is None or rows == 0:  # 0 rows: a chunk's lm_head
        return PLAIN
    if weight.dtype == torch.bfloat16:
        if (
            rows <= _MAX_BF16_GEMV_ROWS
            and in_features % 32 == 0
            and x_dtype == torch.bfloat16
            and _bf16_gemv_ready()
            and weight.is_contiguous()
        ):
            return BF16_GEMV
        if rows >= _MIN_BF16_ONEDNN_ROWS or x_dtype != torch.bfloat16:
            return PLAIN
        return BF16_TILES if packed.dim() == 1 else ONEDNN
    if (
        rows <= max_gemv_rows()
        and in_features % 16 == 0
        and weight.is_contiguous()
        and cpu_ext.load() is not None
    ):
        return GEMV
    if packed.dtype == torch.uint8:  # MKL's layout (pack_weight on Intel)
        return MKL_PACKED
    if mkl_is_fast() and (rows == 1 or rows > _MAX_ROWS_FOR_ONEDNN):
        return PLAIN  # MKL beats oneDNN here (its GEMV at one row)
    return ONEDNN


def padded_rows(rows: int, x_dtype: torch.dtype, kernel: int) -> int:
    """The rows `linear` computes for `rows` input rows on `kernel` (`route`): bfloat16 on
    oneDNN's plain matmul (large prompt steps) pads them with zeros to a multiple of
    _BF16_PLAIN_ROW_STEP, so that each step's new row count does not compile new GEMMs; the
    pad rows' outputs are dropped. Other kernels take the rows as they are."""
    if kernel != PLAIN or x_dtype != torch.bfloat16 or rows < _MIN_BF16_ONEDNN_ROWS:
        return rows
    return -(-rows // _BF16_PLAIN_ROW_STEP) * _BF16_PLAIN_ROW_STEP


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [num_tokens, in] -> [num_tokens, out]; `packed` from `pack_weight(weight)`.

    `packed` also marks a weight as a CPU float32 or bfloat16 matrix the fast paths may take."""
    rows = x.shape[0]
    kernel = route(rows, x.dtype, x.shape[1], weight, packed)
    if kernel == PLAIN:
        padded = padded_rows(rows, x.dtype, kernel) if packed is not None else rows
        plain = _plain_bf16 if packed is not None and x.dtype == torch.bfloat16 else F.linear
        if padded != rows:  # NOTE: the layer loop computes the same padded GEMM, same bits
            x_padded = x.new_zeros(padded, x.shape[1])  # [padded, in]
            x_padded[:rows] = x
            return plain(x_padded, weight, bias)[:rows]
        return plain(x, weight, bias)
    module = cpu_ext.load()
    if kernel == ONEDNN:
        if x.dtype == torch.bfloat16 and module is not None:
            # split between the threads at a few hundred rows, as the layer loop does
            return module.bf16_onednn_linear_rows(x, packed, weight.shape[0], bias)
        return _onednn(x, packed, bias)
    if kernel == GEMV:
        return module.gemv(x.contiguous(), weight, bias)
    if kernel == BF16_GEMV:
        return module.bf16_gemv(x.contiguous(), weight, bias)
    if kernel == MKL_PACKED:
        return module.sgemm_packed_linear(x.contiguous(), packed, weight, bias)
    return module.bf16_vnni_linear(x, packed, weight.shape[0], bias)  # BF16_TILES


def _bf16_tiles_kernels():
    """The compiled module when bfloat16 weights are packed for its tile GEMM: asked for with
    LMENGINE_BF16_GEMM=tiles, on a build with AMX-BF16; else None (oneDNN packs them)."""
    if os.environ.get("LMENGINE_BF16_GEMM", "").lower() != "tiles":
        return None
    module = cpu_ext.load()
    if module is None or not module.bf16_vnni_available():
        return None
    return module


@functools.cache
def _bf16_gemv_built(module) -> bool:
    """Whether `module` has the bfloat16 GEMV (an AVX-512 build): asked once, not per call."""
    return module.bf16_gemv_available()


def _bf16_gemv_ready() -> bool:
    """Whether the compiled kernels are here and have the bfloat16 GEMV."""
    module = cpu_ext.load()
    return module is not None and _bf16_gemv_built(module)


@functools.cache
def max_gemv_rows() -> int:
    """Up to this many rows the compiled weight-streaming GEMV is the fastest: 8, or 24 on a CPU
    without AVX-512 (where it runs 9-24 rows faster than oneDNN); 0 without the kernels."""
    module = cpu_ext.load()
    return 0 if module is None else module.gemv_max_rows()


def _mkl_packed_kernels():
    """The compiled module when MKL's packed GEMM serves the packed weights (Intel CPUs, a torch
    with MKL), else None (then oneDNN packs them)."""
    module = cpu_ext.load()
    if module is None or not mkl_is_fast() or not module.sgemm_packed_available():
        return None
    return module


@functools.cache
def mkl_is_fast() -> bool:
    """True on Intel CPUs, where MKL's GEMMs beat oneDNN's; elsewhere MKL does not take its fast
    code paths. `LMENGINE_GEMM=mkl|onednn` overrides."""
    choice = os.environ.get("LMENGINE_GEMM", "").lower()
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


def _plain_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for a bfloat16 prompt step: below 2,048 rows on two threads the compiled kernel
    splits the rows between them (oneDNN's own split of some shapes there leaves a thread
    idle; csrc/bf16_ops.cpp), as the compiled layer loop does."""
    module = cpu_ext.load()
    if module is None:
        return F.linear(x, weight, bias)
    return module.bf16_linear_rows(x.contiguous(), weight, bias)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
