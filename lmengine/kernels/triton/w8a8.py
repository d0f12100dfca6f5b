"""Triton W8A8 kernels: per-token int8 quantization, fused RMSNorm + quantization, and an int8
GEMM with int32 accumulation and a dequantizing epilogue. Numerics as `lmengine.kernels.w8a8`.

The two row kernels run one program per row. The fused RMSNorm keeps the row in registers
(hidden up to `MAX_BLOCK`); per-token quantization does too up to `MAX_BLOCK`, and walks wider
rows (Llama-7B's 11,008-wide down_proj input) in blocks, once for the maximum and once to
quantize. The GEMM tiles [BLOCK_M, BLOCK_N] outputs and walks K in BLOCK_K steps with
`tl.dot` on int8 tiles into an int32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmengine.kernels.w8a8_checks import check_gemm

MAX_BLOCK = 8192  # widest row the row kernels keep in registers
QMAX = 127.0
_MIN_AMAX = 1e-8
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    is_tie = (r - y) == 0.5
    is_odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(is_tie & is_odd, r - 1.0, r)


@triton.jit
def _quant_store(y, mask, q_row_ptr, scale_ptr, row, offs):
    """y: [BLOCK_SIZE] float32 (0 where masked) -> int8 row and its float32 scale."""
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-8)
    q = _round_half_even(y * (127.0 / amax))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_row_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, amax / 127.0)


@triton.jit
def _per_token_quant_kernel(
    x_ptr,  # [num_rows, hidden] float
    q_ptr,  # [num_rows, hidden] int8
    scale_ptr,  # [num_rows] float32
    stride_x_row,
    stride_q_row,
    hidden,
    BLOCK_SIZE: tl.constexpr,
    ONE_BLOCK: tl.constexpr,  # the whole row fits in BLOCK_SIZE
):
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * stride_x_row
    q_row_ptr = q_ptr + row * stride_q_row
    offs = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    if ONE_BLOCK:
        mask = offs < hidden
        y = tl.load(x_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _quant_store(y, mask, q_row_ptr, scale_ptr, row, offs)
    else:  # two passes over the row, block by block: its maximum, then the int8 values
        amax = 0.0
        for start in range(0, hidden, BLOCK_SIZE):
            mask = start + offs < hidden
            y = tl.load(x_row_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=0))
        amax = tl.maximum(amax, 1e-8)
        for start in range(0, hidden, BLOCK_SIZE):
            mask = start + offs < hidden
            y = tl.load(x_row_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            q = _round_half_even(y * (127.0 / amax))
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(q_row_ptr + start + offs, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + row, amax / 127.0)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden]; read only if HAS_RESIDUAL
    weight_ptr,  # [hidden]
    q_ptr,  # [num_rows, hidden] int8
    scale_ptr,  # [num_rows] float32
    residual_out_ptr,  # [num_rows, hidden] = residual + x; written only if HAS_RESIDUAL
    stride_x_row,
    stride_residual_row,
    stride_q_row,
    stride_residual_out_row,
    hidden,
    eps,
    BLOCK_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    in_dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + offs, mask=mask, other=0.0)
        # round the sum to the input dtype, as `residual + x` does in PyTorch
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(in_dtype)
        tl.store(residual_out_ptr + row * stride_residual_out_row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # as rms_norm_ref: normalise in float32 and cast to the input dtype; the weight multiply
    # is in float32 here (the reference rounds it to float16/bfloat16 when both inputs are:
    # at most one quantization step apart, see the tests)
    y = (xf * rstd).to(in_dtype).to(tl.float32) * weight
    _quant_store(y, mask, q_ptr + row * stride_q_row, scale_ptr, row, offs)


@triton.jit
def _int8_gemm_kernel(
    a_ptr,  # [M, K] int8
    w_ptr,  # [N, K] int8
    out_ptr,  # [M, N]: out dtype if DEQUANT else int32
    a_scale_ptr,  # [M] float32
    w_scale_ptr,  # [N] float32
    bias_ptr,  # [N]; read only if HAS_BIAS
    M,
    N,
    K,
    stride_a_m,
    stride_a_k,
    stride_w_n,
    stride_w_k,
    stride_out_m,
    stride_out_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_a_m + ks[None, :] * stride_a_k,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + offs_n[None, :] * stride_w_n + ks[:, None] * stride_w_k,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
    out_ptrs = out_ptr + offs_m[:, None] * stride_out_m + offs_n[None, :] * stride_out_n
    mask = mask_m[:, None] & mask_n[None, :]
    if DEQUANT:
        a_scale = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
        out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


# ---- launchers ----------------------------------------------------------------------------------


def _check_rows(x: torch.Tensor, op: str, max_hidden: int | None = MAX_BLOCK) -> None:
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{op}: x must be a float16/bfloat16/float32 [num_rows, hidden] tensor, got "
            f"{x.dtype} {tuple(x.shape)}"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"{op}: x must have a contiguous last dimension")
    if x.shape[1] < 1 or (max_hidden is not None and x.shape[1] > max_hidden):
        raise ValueError(f"{op}: hidden must be in 1..{max_hidden}, got {x.shape[1]}")


def per_token_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_rows, hidden] -> (q int8 [num_rows, hidden], scale f32 [num_rows, 1])."""
    _check_rows(x, "per_token_quant_triton", max_hidden=None)
    num_rows, hidden = x.shape
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows:
        block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
        _per_token_quant_kernel[(num_rows,)](
            x, q, scale, x.stride(0), q.stride(0), hidden, BLOCK_SIZE=block,
            ONE_BLOCK=hidden <= block,
        )  # fmt: skip
    return q, scale


def rms_norm_quant_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (q int8, scale f32 [num_rows, 1], residual + x or None); see rms_norm_quant_ref."""
    op = "rms_norm_quant_triton"
    _check_rows(x, op)
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous [{x.shape[1]}], got {weight.shape}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: weight must be a float tensor, got {weight.dtype}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(f"{op}: residual must match x in shape and dtype")
    num_rows, hidden = x.shape
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    if num_rows:
        res = residual if residual is not None else x
        res_out = summed if summed is not None else x
        _rms_norm_quant_kernel[(num_rows,)](
            x,
            res,
            weight,
            q,
            scale,
            res_out,
            x.stride(0),
            res.stride(0),
            q.stride(0),
            res_out.stride(0),
            hidden,
            float(eps),
            BLOCK_SIZE=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    return q, scale, summed


def _gemm_blocks(m: int) -> tuple[int, int, int]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, 64


def _launch_gemm(a_q, a_scale, w_q, w_scale, bias, out: torch.Tensor, dequant: bool) -> None:
    m, k = a_q.shape
    n = w_q.shape[0]
    if m == 0 or n == 0:
        return
    block_m, block_n, block_k = _gemm_blocks(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](
        a_q,
        w_q,
        out,
        a_scale,
        w_scale,
        bias if bias is not None else w_scale,
        m,
        n,
        k,
        a_q.stride(0),
        a_q.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_BIAS=bias is not None,
        DEQUANT=dequant,
    )


def _check_gemm(a_q, a_scale, w_q, w_scale, op: str) -> None:
    check_gemm(a_q, a_scale, w_q, w_scale, op)
    if not (a_scale.is_contiguous() and w_scale.is_contiguous()):
        raise ValueError(f"{op}: a_scale and w_scale must be contiguous")
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError(f"{op}: a_scale and w_scale must be float32")


def int8_mm_triton(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """The raw accumulator: a_q [M, K] int8 @ w_q [N, K].T -> [M, N] int32."""
    dummy_a = torch.ones(a_q.shape[0], 1, dtype=torch.float32, device=a_q.device)
    dummy_w = torch.ones(w_q.shape[0], dtype=torch.float32, device=a_q.device)
    _check_gemm(a_q, dummy_a, w_q, dummy_w, "int8_mm_triton")
    out = torch.empty(a_q.shape[0], w_q.shape[0], dtype=torch.int32, device=a_q.device)
    _launch_gemm(a_q, dummy_a, w_q, dummy_w, None, out, dequant=False)
    return out


def int8_gemm_triton(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[M, K] int8 x [N, K] int8 -> [M, N] out_dtype, dequantized in the epilogue."""
    _check_gemm(a_q, a_scale, w_q, w_scale, "int8_gemm_triton")
    out = torch.empty(a_q.shape[0], w_q.shape[0], dtype=out_dtype, device=a_q.device)
    _launch_gemm(a_q, a_scale, w_q, w_scale, bias, out, dequant=True)
    return out
