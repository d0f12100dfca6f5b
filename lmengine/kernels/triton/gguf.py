"""Triton GEMM on GGUF blocks (Q4_0, Q4_1, Q8_0; not yet the K types), weight-only: numerics
as `lmengine.kernels.gguf`.

A program computes a [BLOCK_M, BLOCK_N] tile of y = x @ W^T (+ bias) and walks K one GGUF block
(32 weights) at a time: it loads the block of each of its BLOCK_N weight rows (the half scale,
the Q4_1 minimum, the 16 or 32 bytes of quants), unpacks the 32 weights in registers to the
float32 values `gguf.quants.dequantize` gives (d * (q - 8), d * q + m, d * q: exact products),
and multiplies them with the x tile in an IEEE float32 `tl.dot` (no TF32 rounding), so the model
computes with its float32 expansion's weights. Layouts in kernels/csrc/gguf_ops.cpp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmengine.kernels.gguf_types import BLOCK_BYTES, TRITON_QTYPES, check_qtype


@triton.jit
def _half(ptr, mask):
    """The float16 at byte pointer(s) `ptr` (little-endian), as float32 (0 where masked)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,  # [M, K] float32
    w_ptr,  # [N, row_bytes] uint8 blocks
    bias_ptr,  # [N] float32; read only if HAS_BIAS
    y_ptr,  # [M, N] float32
    M,
    N,
    K,
    stride_x_m,
    stride_w_n,
    stride_y_m,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, 32)  # the weights of one block
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64) * stride_w_n  # [BLOCK_N] row starts
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // 32):
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_x_m + (b * 32 + offs_k)[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )  # [BLOCK_M, 32]
        block = rows + b * BLOCK_BYTES  # [BLOCK_N]
        d = _half(block, mask_n)  # [BLOCK_N]
        if QTYPE == 8:  # Q8_0 (ggml's type ids: Q4_0 2, Q4_1 3, Q8_0 8): 32 signed bytes
            q = tl.load(block[:, None] + 2 + offs_k[None, :], mask=mask_n[:, None], other=0)
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, None]
        else:  # 4-bit: byte j holds weight j in its low nibble and weight j + 16 in its high
            QS: tl.constexpr = 4 if QTYPE == 3 else 2  # the quants follow d (and m)
            byte = tl.load(
                block[:, None] + QS + (offs_k % 16)[None, :], mask=mask_n[:, None], other=0
            ).to(tl.int32)  # [BLOCK_N, 32]
            q = ((byte >> ((offs_k // 16) * 4)[None, :]) & 15).to(tl.float32)
            if QTYPE == 3:  # Q4_1: d * q + m
                w = q * d[:, None] + _half(block + 2, mask_n)[:, None]
            else:  # Q4_0: d * (q - 8)
                w = (q - 8.0) * d[:, None]
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_y_m + offs_n[None, :],
        acc,
        mask=mask_m[:, None] & mask_n[None, :],
    )


def gguf_gemm_triton(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x float32 [M, K] @ dequantize(blocks)^T (+ bias) -> float32 [M, N]; blocks uint8
    [N, K / 32 * bytes per block] of `qtype`, on x's device."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"gguf_gemm_triton: x must be float32 [M, K], got {x.dtype} {x.shape}")
    m, k = x.shape
    name = check_qtype(qtype, k, blocks.shape[-1])
    if qtype not in TRITON_QTYPES:
        raise ValueError(f"gguf_gemm_triton: {name} blocks are not supported (Q4_0, Q4_1, Q8_0)")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.device != x.device:
        raise ValueError("gguf_gemm_triton: blocks must be uint8 [N, row bytes] on x's device")
    n = blocks.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32):
        raise ValueError(f"gguf_gemm_triton: bias must be float32 [{n}]")
    x = x.contiguous()
    blocks = blocks.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 32  # tl.dot's smallest tile is 16
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_gemm_kernel[grid](
        x, blocks, bias if bias is not None else y, y, m, n, k,
        x.stride(0), blocks.stride(0), y.stride(0),
        QTYPE=qtype, BLOCK_BYTES=BLOCK_BYTES[name], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return y
