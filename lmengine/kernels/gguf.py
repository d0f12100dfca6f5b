"""Linear layers on GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), weight-only.

A weight stays as GGUF stores it: uint8 [N, K / weights per block * bytes per block], each row
a run of blocks of 32 weights (256 in the K types; layouts in kernels/csrc/gguf_ops.cpp).
Activations stay float32 and every weight is unpacked to exactly the float32 value
`gguf.quants.dequantize` gives it, so a model computes with the weights of its float32
expansion.

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
from lmengine.kernels.gguf_types import (  # noqa: F401  (the types' tables live there)
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    QTYPES,
    TRITON_QTYPES,
    check_qtype,
)

MAX_GEMV_ROWS = 8
# Up to this many rows `gguf_gemm` (panels of weight rows unpacked into the cache, register
# tiles of dot products) beats expanding each weight for MKL's GEMM; measured on SmolLM2's
# Q4_1 linears, Intel Xeon (family 6, model 167): 9 / 24 / 64 rows 15 / 27 / 59 ms against
# 24-44 / 44-109 / 67-130 for the expansion (and 29 / 37 / 56 for float32 on packed weights);
# equal at 80 rows, behind from 96 on (85 against 77 ms).
MAX_GEMM_ROWS = 80


def dequantize_ref(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 blocks [N, row bytes] holding rows of `k` weights -> float32 [N, k]."""
    name = check_qtype(qtype, k, blocks.shape[-1])
    n = blocks.shape[0]
    b = blocks.reshape(n, k // BLOCK_WEIGHTS[name], BLOCK_BYTES[name])
    if name == "Q4_K":
        return _dequantize_q4_k(b).reshape(n, k)
    if name == "Q6_K":
        return _dequantize_q6_k(b).reshape(n, k)
    d = _half(b[..., 0:2])  # [n, blocks, 1]
    if name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        w = q * d
    else:
        qs = b[..., 4:] if name == "Q4_1" else b[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # weights 0-15, then 16-31
        if name == "Q4_0":
            w = (q - 8.0) * d
        else:
            w = q * d + _half(b[..., 2:4])
    return w.reshape(n, k)


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] (a little-endian float16) -> float32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """q uint8 [..., 1, L] -> [..., len(shifts), L]: (q >> shift) & mask for each shift."""
    return (q >> torch.tensor(shifts, dtype=torch.uint8).view(-1, 1)) & mask


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks uint8 [n, blocks, 144] -> float32 [n, blocks, 256]: (d * sc) * q - dmin * m
    per group of 32 (layout in kernels/csrc/gguf_ops.cpp)."""
    n, nb = b.shape[:2]
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # [n, nb, 1]
    s = b[..., 4:16].reshape(n, nb, 3, 4)
    low, mid, top = s[..., 0, :], s[..., 1, :], s[..., 2, :]  # bytes 0-3, 4-7, 8-11
    sc = torch.cat([low & 63, (top & 15) | ((low >> 2) & 48)], dim=-1).float()  # [n, nb, 8]
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 2) & 48)], dim=-1).float()
    q = _nibbles(b[..., 16:].reshape(n, nb, 4, 1, 32), [0, 4], 15).reshape(n, nb, 8, 32)
    return ((d * sc).unsqueeze(-1) * q.float() - (dmin * m).unsqueeze(-1)).reshape(n, nb, 256)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks uint8 [n, blocks, 210] -> float32 [n, blocks, 256]: (d * sc) * (q - 32) per
    16 weights, q's low 4 bits and high 2 bits stored apart."""
    n, nb = b.shape[:2]
    low = _nibbles(b[..., :128].reshape(n, nb, 2, 1, 64), [0, 4], 15).reshape(n, nb, 8, 32)
    high = _nibbles(b[..., 128:192].reshape(n, nb, 2, 1, 32), [0, 2, 4, 6], 3)
    q = (low | (high.reshape(n, nb, 8, 32) << 4)).float() - 32.0
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [n, nb, 16]
    d = _half(b[..., 208:210])
    return ((d * sc).unsqueeze(-1) * q.reshape(n, nb, 16, 16)).reshape(n, nb, 256)


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
    if x.is_cuda and qtype in TRITON_QTYPES:
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
