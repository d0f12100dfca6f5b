"""Int8 KV cache: symmetric per-token-per-head quantization, the reference every path follows.

One (token, KV head) row of `head_dim` values x is stored as int8 `q = round(x / s)` with the
float32 scale `s = max|x| / 127`, so `q` lies in [-127, 127] and `q * s` gives x back within
s / 2 per value. An all-zero row has s = 0 and stores zeros. Scales live next to the int8 pages,
one float32 per (block, slot, KV head): [num_blocks, block_size, num_kv_heads].
"""

from __future__ import annotations

import torch

QMAX = 127.0


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] float -> (int8 [..., head_dim], float32 scale [...])."""
    xf = x.float()
    scale = xf.abs().amax(-1) / QMAX  # [...]
    # NOTE: an all-zero row divides by 1 instead of 0; its values are 0 anyway
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_kv_ref(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q: int8 [..., head_dim]; scale: [...] -> [..., head_dim] in `dtype`."""
    return (q.float() * scale[..., None].float()).to(dtype)


def dequantize_kv(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Same meaning as dequantize_kv_ref, one fused multiply in `dtype` (the CPU gather path)."""
    return q.to(dtype).mul_(scale.to(dtype).unsqueeze(-1))
