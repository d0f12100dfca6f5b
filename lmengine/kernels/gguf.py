"""Linear layers on GGUF's quantized blocks (Q4_0, Q4_1, Q8_0), weight-only.

A weight stays as GGUF stores it: uint8 [N, K / 32 * bytes per block], each row a run of
blocks of 32 weights (layouts in kernels/csrc/gguf_ops.cpp). Activations stay float32 and every
weight is unpacked to exactly the float32 value `gguf.quants.dequantize` gives it, so a model
computes with the weights of its float32 expansion.

- `gguf_linear(x, blocks, qtype, k, bias)`: up to 8 rows (decode) through the compiled
  `gguf_gemv` (`gemv_kernel`), which unpacks blocks in registers and reads 3.8-6x fewer bytes
  than a float32 GEMV; up to 80 rows (decode batches) through `gguf_gemm`, which unpacks each
  panel of 32 weight rows once into the core's cache and multiplies every row with it; more
  rows (prefill) expand the weight to float32 first and run a float32 GEMM. On CUDA, the
  Triton GEMM of `lmengine.kernels.triton.gguf`, which unpacks the blocks in registers.
- `dequantize_ref`: the same expansion in PyTorch, the fallback where the compiled kernels are
  not built and the reference of the tests (themselves checked against the gguf package).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext

BLOCK = 32  # weights per block
# ggml's type ids (gguf.GGMLQuantizationType) -> bytes per block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
_NAMES = {v: k for k, v in QTYPES.items()}
MAX_GEMV_ROWS = 8
# Up to this many rows `gguf_gemm` (panels of weight rows unpacked into the cache, register
# tiles of dot products) beats expanding each weight for MKL's GEMM; measured on SmolLM2's
# Q4_1 linears, Intel Xeon (family 6, model 167): 9 / 24 / 64 rows 15 / 27 / 59 ms against
# 24-44 / 44-109 / 67-130 for the expansion (and 29 / 37 / 56 for float32 on packed weights);
# equal at 80 rows, behind from 96 on (85 against 77 ms).
MAX_GEMM_ROWS = 80


def check_qtype(qtype: int, k: int, row_bytes: int | None = None) -> str:
    """The type's name; ValueError naming an unsupported type (and the supported ones) or a
    row length that does not fit it."""
    name = _NAMES.get(qtype)
    if name is None:
        supported = ", ".join(f"{n} ({i})" for n, i in QTYPES.items())
        raise ValueError(f"GGUF quantization type {qtype} is not supported: {supported}")
    if k <= 0 or k % BLOCK:
        raise ValueError(f"GGUF {name}: rows must hold a multiple of {BLOCK} weights, got {k}")
    if row_bytes is not None and row_bytes != k // BLOCK * BLOCK_BYTES[name]:
        raise ValueError(
            f"GGUF {name}: a row of {k} weights takes {k // BLOCK * BLOCK_BYTES[name]} bytes, "
            f"got {row_bytes}"
        )
    return name


def dequantize_ref(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 blocks [N, row bytes] holding rows of `k` weights -> float32 [N, k]."""
    name = check_qtype(qtype, k, blocks.shape[-1])
    n = blocks.shape[0]
    b = blocks.reshape(n, k // BLOCK, BLOCK_BYTES[name])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    if name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        w = q * d
    else:
        qs = b[..., 4:] if name == "Q4_1" else b[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # weights 0-15, then 16-31
        if name == "Q4_0":
            w = (q - 8.0) * d
        else:
            w = q * d + b[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(n, k)


def dequantize(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """`dequantize_ref`'s result, by the compiled kernel when it is built."""
    module = cpu_ext.load() if blocks.device.type == "cpu" else None
    if module is None:
        return dequantize_ref(blocks, qtype, k)
    check_qtype(qtype, k, blocks.shape[-1])
    return module.gguf_dequantize(blocks.contiguous(), qtype, k)


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    checked: bool = False,
) -> torch.Tensor:
    """x float32 [M, k] -> [M, N] = x @ dequantize(blocks)^T (+ bias). `checked`: the blocks
    were checked beforehand (a layer checks its own once, not at every step)."""
    if not checked:
        check_qtype(qtype, k, blocks.shape[-1])
        if x.shape[-1] != k:
            raise ValueError(f"gguf_linear: x has {x.shape[-1]} features, the weight {k}")
    if x.is_cuda:
        from lmengine.kernels.triton.gguf import gguf_gemm_triton

        # float32 activations and sums whatever the model's dtype
        y = gguf_gemm_triton(x.float(), blocks, qtype, None if bias is None else bias.float())
        return y.to(x.dtype)
    gemv = gemv_kernel(x)
    if gemv is not None:
        return gemv(x.contiguous(), blocks.contiguous(), qtype, bias)
    module = cpu_ext.load() if x.device.type == "cpu" else None
    if module is not None and x.shape[0] <= MAX_GEMM_ROWS and x.dtype == torch.float32:
        return module.gguf_gemm(x.contiguous(), blocks.contiguous(), qtype, bias)
    return F.linear(x, dequantize(blocks, qtype, k).to(x.dtype), bias)


def gemv_kernel(x: torch.Tensor):
    """The compiled `gguf_gemv` when it serves `x` (float32 CPU rows, 1 to 8 of them), else
    None."""
    if not 1 <= x.shape[0] <= MAX_GEMV_ROWS or x.dtype != torch.float32:
        return None
    module = cpu_ext.load() if x.device.type == "cpu" else None
    return None if module is None else module.gguf_gemv
