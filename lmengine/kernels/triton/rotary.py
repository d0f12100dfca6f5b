"""Triton rotary position embedding, NeoX "rotate half" layout (as transformers' Llama).

q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim] (any token and
head strides, contiguous last dim); cos, sin: [num_tokens, head_dim], already gathered per token.
With x = [x1, x2] split into halves, out = [x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2].
One program handles every q and k head of one token, in tiles of BLOCK_H heads x half a head.
Products are computed in float32 and rounded once to the output dtype, which is
`torch.promote_types(q.dtype, cos.dtype)` as in `apply_rotary_ref`. Returns new tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_heads, head_dim] of one token
    out_ptr,  # [num_heads, head_dim] of one token
    stride_x_h,
    stride_out_h,
    num_heads,
    half_dim,
    cos1,  # [BLOCK_HALF] float32, first half of cos
    cos2,  # [BLOCK_HALF] float32, second half of cos
    sin1,  # [BLOCK_HALF] float32
    sin2,  # [BLOCK_HALF] float32
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask_d = offs_d < half_dim
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + offs_h
        mask = (heads < num_heads)[:, None] & mask_d[None, :]  # [BLOCK_H, BLOCK_HALF]
        x1_ptrs = x_ptr + heads[:, None] * stride_x_h + offs_d[None, :]
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
        x2 = tl.load(x1_ptrs + half_dim, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
        out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
        out1_ptrs = out_ptr + heads[:, None] * stride_out_h + offs_d[None, :]
        tl.store(out1_ptrs, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out1_ptrs + half_dim, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_ptr,  # [num_tokens, head_dim]
    sin_ptr,  # [num_tokens, head_dim]
    q_out_ptr,  # [num_tokens, num_heads, head_dim]
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cos_t,
    stride_sin_t,
    stride_q_out_t,
    stride_q_out_h,
    stride_k_out_t,
    stride_k_out_h,
    num_heads,
    num_kv_heads,
    half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask_d = offs_d < half_dim
    cos_row = cos_ptr + tok * stride_cos_t
    sin_row = sin_ptr + tok * stride_sin_t
    cos1 = tl.load(cos_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    cos2 = tl.load(cos_row + half_dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + half_dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + tok * stride_q_t,
        q_out_ptr + tok * stride_q_out_t,
        stride_q_h,
        stride_q_out_h,
        num_heads,
        half_dim,
        cos1,
        cos2,
        sin1,
        sin2,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + tok * stride_k_t,
        k_out_ptr + tok * stride_k_out_t,
        stride_k_h,
        stride_k_out_h,
        num_kv_heads,
        half_dim,
        cos1,
        cos2,
        sin1,
        sin2,
        BLOCK_H,
        BLOCK_HALF,
    )


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    op = "apply_rotary_triton"
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"{op}: q and k must be [num_tokens, heads, head_dim], got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"{op}: k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if head_dim % 2 != 0:
        raise ValueError(f"{op}: head_dim must be even, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_tokens, head_dim):
            raise ValueError(
                f"{op}: {name} must be [{num_tokens}, {head_dim}] to match q, got {tuple(t.shape)}"
            )
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{op}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous last dimension")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if k.dtype != q.dtype:
        raise ValueError(f"{op}: q and k dtypes differ ({q.dtype} vs {k.dtype})")
    if sin.dtype != cos.dtype:
        raise ValueError(f"{op}: cos and sin dtypes differ ({cos.dtype} vs {sin.dtype})")


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
    cos, sin: [num_tokens, head_dim]. Returns rotated (q, k) as new contiguous tensors."""
    _check(q, k, cos, sin)
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out, k_out
    half_block = triton.next_power_of_2(head_dim // 2)
    # tiles of at most ~2048 elements per half
    block_h = min(triton.next_power_of_2(max(num_heads, k.shape[1])), max(2048 // half_block, 1))
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        num_heads,
        k.shape[1],
        head_dim // 2,
        BLOCK_H=block_h,
        BLOCK_HALF=half_block,
        num_warps=4,
    )
    return q_out, k_out
