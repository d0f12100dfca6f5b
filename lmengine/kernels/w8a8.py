"""W8A8 kernels: per-token int8 quantization, RMSNorm fused with it, and an int8 GEMM whose
epilogue dequantizes.

Numerics (all paths):
- per-token quantization: `scale = max(|x_row|, 1e-8) / 127` (float32), `q = rint(x * (127 /
  max))` clamped to [-127, 127], rounding half to even. Symmetric: no zero point, -128 unused.
- int8 GEMM: int8 x int8 products accumulated exactly in int32; then `out = acc * a_scale[m] *
  w_scale[n] (+ bias)` in float32, cast to the output dtype.

Each op has a PyTorch reference (`*_ref`), a CPU path and a Triton kernel on CUDA
(`lmengine.kernels.triton.w8a8`). The public functions dispatch on the device of their inputs.
The CPU path is the compiled kernels of `csrc/w8a8_ops.cpp` (one call per quantization or
linear, bit-identical to the references; the GEMM is `torch._int_mm`, oneDNN's int8 matmul on
a packed weight, or on CPUs with AMX-INT8 oneDNN's brgemm microkernel on a weight packed for
the tiles; the fused RMSNorm + quantization sums its squares in its own order, as the Triton
kernel does, so it may land one int8 step from the reference on a rounding boundary), or
vectorised eager torch where they are not built.

bfloat16 activations (a w8a8 model computing in bfloat16): the quantization reads bfloat16
rows (widened exactly, so bit-identical to the reference's `x.to(float32)`), the epilogue
computes in float32 as above and rounds once to bfloat16 (bit-identical to `dequant_ref`), and
the fused RMSNorm / SwiGLU + quantization round to bfloat16 where transformers' bfloat16 ops
round, then quantize that row (within one int8 step of the reference on rounding boundaries).
"""

from __future__ import annotations

import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.activation import silu_mul_compiled_takes
from lmengine.kernels.rms_norm import compiled_norm_takes, rms_norm_cpu
from lmengine.kernels.w8a8_checks import check_gemm, check_rows

QMAX = 127
# from this many rows `int8_gemm` takes the AMX-INT8 GEMM where the weight was packed for it:
# every row count (one row: 56 us against 149 for `_int_mm` over SmolLM2's four linears)
AMX_MIN_ROWS = 1
_MIN_AMAX = 1e-8  # an all-zero row quantizes to zeros with a tiny, finite scale


# ---- per-token quantization --------------------------------------------------------------------


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, hidden] float -> (q [num_tokens, hidden] int8, scale [num_tokens, 1] f32)."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX)  # [num_tokens, 1]
    q = torch.round(xf * (QMAX / amax)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


def per_token_quant_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-identical to the reference: the compiled kernel (float32 or bfloat16 rows), else
    eager torch in fewer passes (no clamp: |x| * 127 / max|x| <= 127 rounds to at most 127;
    the rounding in place).
    NOTE: `abs().amax()` is kept over `vector_norm(inf)`, which was 7x slower here."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return per_token_quant_ref(x)
    ops = cpu_ext.load()
    if ops is not None:
        return ops.w8a8_quant(x)
    if x.dtype != torch.float32:
        return per_token_quant_ref(x)
    amax = x.abs().amax(dim=-1, keepdim=True)  # [num_tokens, 1]
    amax.clamp_(min=_MIN_AMAX)
    q = torch.mul(x, QMAX / amax).round_().to(torch.int8)  # [num_tokens, hidden]
    return q, amax / QMAX


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_rows(x, "per_token_quant")
    if x.is_cuda:
        from lmengine.kernels.triton.w8a8 import per_token_quant_triton

        return per_token_quant_triton(x)
    return per_token_quant_cpu(x)


# ---- RMSNorm + quantization ---------------------------------------------------------------------


def rms_norm_quant_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of `x` (of `residual + x` when given), then per-token quantization.

    Returns (q [num_tokens, hidden] int8, scale [num_tokens, 1] f32, residual + x or None).
    The norm follows `rms_norm_ref` (transformers' LlamaRMSNorm) exactly.
    """
    from lmengine.kernels.rms_norm import rms_norm_ref

    summed = None if residual is None else residual + x
    normed = rms_norm_ref(x if summed is None else summed, weight, eps)  # [num_tokens, hidden]
    q, scale = per_token_quant_ref(normed)
    return q, scale, summed


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fused RMSNorm (optionally after the residual add) + per-token int8 quantization."""
    check_rows(x, "rms_norm_quant")
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm_quant: hidden size {x.shape[-1]} != weight size {weight.shape[0]}"
        )
    if x.is_cuda:
        from lmengine.kernels.triton.w8a8 import rms_norm_quant_triton

        return rms_norm_quant_triton(x, weight, eps, residual)
    ops = cpu_ext.load()
    if ops is not None and compiled_norm_takes(x, weight, residual):
        q, scale, summed = ops.w8a8_rms_norm_quant(x, weight, eps, residual)
        return q, scale, summed if residual is not None else None
    normed, summed = rms_norm_cpu(x, weight, eps, residual)
    q, scale = per_token_quant_cpu(normed)
    return q, scale, summed


# ---- SwiGLU product (+ quantization) -------------------------------------------------------------


def silu_mul_quant_cpu(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`silu_mul_ref` quantized per token ((q, scale) as `per_token_quant`) in one compiled
    pass (silu within a few ulp of torch's; in bfloat16 rounded where torch's bfloat16 silu and
    multiply round); None where the compiled kernels cannot take it (not float32 or bfloat16
    CPU rows, or not built). The float product alone is `activation.silu_mul`."""
    if not silu_mul_compiled_takes(gate_up):
        return None
    ops = cpu_ext.load()
    return None if ops is None else ops.w8a8_silu_mul(gate_up)


# ---- int8 GEMM ----------------------------------------------------------------------------------


def int8_mm_ref(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact accumulator: a_q [M, K] int8 @ w_q[N, K].T -> [M, N] int32 (computed in int64)."""
    acc = a_q.to(torch.int64) @ w_q.to(torch.int64).t()  # [M, N]
    return acc.to(torch.int32)  # |acc| <= K * 127^2 fits int32 for K < 133,000


def dequant_ref(
    acc: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The epilogue: acc [M, N] int32 -> acc * a_scale [M, 1] * w_scale [N] (+ bias)."""
    out = acc.to(torch.float32) * a_scale * w_scale  # [M, N]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def int8_gemm_ref(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """a_q [M, K] int8, a_scale [M, 1] f32, w_q [N, K] int8, w_scale [N] f32 -> [M, N]."""
    check_gemm(a_q, a_scale, w_q, w_scale, "int8_gemm_ref")
    return dequant_ref(int8_mm_ref(a_q, w_q), a_scale, w_scale, bias, out_dtype)


def int8_mm_cpu(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """[M, K] int8 @ [N, K].T int8 -> [M, N] int32 with `torch._int_mm` (exact)."""
    # NOTE: w_q.t() is a view with K contiguous, the layout _int_mm is fastest with (a
    # row-major [K, N] copy of the weight made the one-row GEMM ~7x slower here).
    return torch._int_mm(a_q.contiguous(), w_q.t())


def pack_int8_weight(w_q: torch.Tensor) -> torch.Tensor | None:
    """w_q [N, K] int8 in oneDNN's int8 matmul layout, for `int8_gemm(packed=...)` on the CPU
    from 2 rows on; None where the compiled kernels or oneDNN's int8 ops are missing."""
    if w_q.is_cuda or w_q.dtype != torch.int8:
        return None
    ops = cpu_ext.load()
    return None if ops is None else ops.w8a8_pack(w_q)


def pack_int8_weight_amx(w_q: torch.Tensor) -> torch.Tensor | None:
    """w_q [N, K] int8 in blocks for the AMX-INT8 GEMM (`int8_gemm(packed_amx=...)`: oneDNN's
    brgemm microkernel, int8 x int8 on the tiles), or None where that GEMM does not run: no
    AMX-INT8, K not a multiple of 4, or the compiled kernels are missing."""
    if w_q.is_cuda or w_q.dtype != torch.int8 or w_q.dim() != 2:
        return None
    ops = cpu_ext.load()
    return None if ops is None else ops.w8a8_vnni_pack(w_q)


def int8_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    packed: torch.Tensor | None = None,
    packed_amx: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 GEMM with int32 accumulation and a dequantizing epilogue; see `int8_gemm_ref`.
    `packed`: `pack_int8_weight(w_q)`, which the CPU path uses from 2 rows on; `packed_amx`:
    `pack_int8_weight_amx(w_q)`, which it prefers from `AMX_MIN_ROWS` rows on (same result)."""
    check_gemm(a_q, a_scale, w_q, w_scale, "int8_gemm")
    if a_q.is_cuda:
        from lmengine.kernels.triton.w8a8 import int8_gemm_triton

        return int8_gemm_triton(a_q, a_scale, w_q, w_scale, bias, out_dtype)
    if a_q.shape[0] == 0:
        return torch.empty(0, w_q.shape[0], dtype=out_dtype)
    ops = cpu_ext.load()
    if ops is not None and _compiled_epilogue_takes(out_dtype, bias):
        bf16_out = out_dtype == torch.bfloat16
        if packed_amx is not None and a_q.shape[0] >= AMX_MIN_ROWS:
            n = w_q.shape[0]
            return ops.w8a8_vnni_linear(a_q, a_scale, packed_amx, n, w_scale, bias, bf16_out)
        return ops.w8a8_linear(a_q, a_scale, w_q, w_scale, bias, packed, bf16_out)
    acc = int8_mm_cpu(a_q, w_q)  # [M, N] int32
    out = torch.mul(acc, a_scale)  # int32 * f32 -> f32 [M, N]
    out.mul_(w_scale)
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _compiled_epilogue_takes(out_dtype: torch.dtype, bias: torch.Tensor | None) -> bool:
    """float32 or bfloat16 output, the bias (if any) of that dtype."""
    return out_dtype in (torch.float32, torch.bfloat16) and (
        bias is None or bias.dtype == out_dtype
    )


def w8a8_linear_cpu(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The whole linear on a float32 or bfloat16 CPU input in one compiled call (quantize per
    token, int8 GEMM, dequantize; the output in x's dtype), or None when the compiled kernels
    cannot take it."""
    if x.dim() != 2 or not _compiled_epilogue_takes(x.dtype, bias):
        return None
    ops = cpu_ext.load()
    return None if ops is None else ops.w8a8_linear_float(x, w_q, w_scale, bias, packed)
