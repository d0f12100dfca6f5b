"""RMSNorm, and RMSNorm fused with the residual add that precedes it.

Numerics follow transformers' LlamaRMSNorm exactly: normalise in float32, cast back to the
input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch


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


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One fused op instead of the reference's seven. In float32, torch's fused RMSNorm is
    bit-identical to the reference (checked on 1, 64 and 2,475 rows); other dtypes cast in
    a different order, so they keep the reference."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    if x.is_cuda:
        from lmengine.kernels.triton.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_cpu(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight)
    if x.is_cuda:
        from lmengine.kernels.triton.rms_norm import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    summed = residual + x
    return rms_norm_cpu(summed, weight, eps), summed
