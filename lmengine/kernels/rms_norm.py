"""RMSNorm, and RMSNorm fused with the residual add that precedes it.

Numerics follow transformers' LlamaRMSNorm exactly: normalise in float32, cast back to the
input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch

from lmengine.kernels import cpu_ext


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden]; weight: [hidden] -> [num_tokens, hidden]."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(residual + x), residual + x); both [num_tokens, hidden]."""
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: hidden size {x.shape[-1]} != weight size {weight.shape[0]}")


def compiled_norm_takes(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> bool:
    """float32 or bfloat16 contiguous tensors, all of one dtype."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return x.dtype in (torch.float32, torch.bfloat16) and all(
        t.dtype == x.dtype and t.is_contiguous() for t in tensors
    )


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(residual + x), residual + x), or (rms_norm(x), None) without a residual.

    float32: one compiled pass (csrc/layer_ops.cpp, within a few ulp of the reference: the
    sum of squares is reduced in another order) instead of the residual add plus torch's
    RMSNorm, which runs as ~8 eager ops. Without the compiled kernels torch's fused RMSNorm,
    bit-identical to the reference in float32; other dtypes cast in a different order, so
    they keep the reference. bfloat16 has its own compiled pass (csrc/bf16_ops.cpp), which
    rounds where the reference rounds (the residual sum, the normalised row, the product)."""
    ops = cpu_ext.load() if compiled_norm_takes(x, weight, residual) else None
    if ops is not None:
        norm = ops.rms_norm if x.dtype == torch.float32 else ops.bf16_rms_norm
        return norm(x, weight, eps, residual)
    summed = None if residual is None else residual + x
    src = x if summed is None else summed
    if src.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(src, (src.shape[-1],), weight, eps), summed
    return rms_norm_ref(src, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    if x.is_cuda:
        from lmengine.kernels.triton.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_cpu(x, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight)
    if x.is_cuda:
        from lmengine.kernels.triton.rms_norm import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return rms_norm_cpu(x, weight, eps, residual)
