"""Rotary position embedding ("rotate half" / NeoX layout, as transformers' Llama).

cos and sin are per token, already gathered for each token's position: [num_tokens, head_dim]
with the two halves equal, as transformers' rotary modules return them.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
    cos, sin: [num_tokens, head_dim]. Returns rotated (q, k), new tensors."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half(x) * sin == roll(x, d/2) * (sin with its first half negated): one roll
    instead of two slices, a negation and a concatenation per tensor. Bit-identical to the
    reference (a sign flip is exact)."""
    half = q.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]
    cos = cos[:, None, :]
    return (
        q * cos + q.roll(half, -1) * signed_sin,
        k * cos + k.roll(half, -1) * signed_sin,
    )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.shape[0] != cos.shape[0] or q.shape[-1] != cos.shape[-1]:
        raise ValueError(f"apply_rotary: q {tuple(q.shape)} does not fit cos {tuple(cos.shape)}")
    if q.is_cuda:
        from lmengine.kernels.triton.rotary import apply_rotary_triton

        return apply_rotary_triton(q, k, cos, sin)
    return apply_rotary_cpu(q, k, cos, sin)
