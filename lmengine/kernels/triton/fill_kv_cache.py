"""Triton write of this step's keys and values into the paged KV cache, in place.

k, v: [num_tokens, num_kv_heads, head_dim] (any token and head strides, contiguous last dim);
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (any block, slot and head
strides, contiguous last dim, so per-layer views of a larger pool work). slot_mapping:
[num_tokens] int64 or int32 flat slots, block_id * block_size + offset. One program copies one
token's [num_kv_heads, head_dim] keys and values. A negative slot marks a padding token and is
skipped (nothing is written); slots are otherwise not bounds-checked on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fill_kv_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32 or int64
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_k_cache_b,
    stride_k_cache_s,
    stride_k_cache_h,
    stride_v_cache_b,
    stride_v_cache_s,
    stride_v_cache_h,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    # a padding token (negative slot) copies nothing: its valid width drops to 0
    mask_d = (offs_d < tl.where(slot >= 0, head_dim, 0))[None, :]  # [1, BLOCK_D]
    k_src = k_ptr + tok * stride_k_t
    v_src = v_ptr + tok * stride_v_t
    k_dst = k_cache_ptr + block * stride_k_cache_b + offset * stride_k_cache_s
    v_dst = v_cache_ptr + block * stride_v_cache_b + offset * stride_v_cache_s
    for h0 in range(0, num_kv_heads, BLOCK_H):
        heads = h0 + offs_h
        mask = (heads < num_kv_heads)[:, None] & mask_d  # [BLOCK_H, BLOCK_D]
        k = tl.load(k_src + heads[:, None] * stride_k_h + offs_d[None, :], mask=mask)
        v = tl.load(v_src + heads[:, None] * stride_v_h + offs_d[None, :], mask=mask)
        tl.store(k_dst + heads[:, None] * stride_k_cache_h + offs_d[None, :], k, mask=mask)
        tl.store(v_dst + heads[:, None] * stride_v_cache_h + offs_d[None, :], v, mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    op = "fill_kv_cache_triton"
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"{op}: k and v must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{op}: k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"{op}: k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"{op}: slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if k.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: k must be float16, bfloat16 or float32, got {k.dtype}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != k.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} differs from k dtype {k.dtype}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous last dimension")
    if not slot_mapping.is_contiguous():
        raise ValueError(f"{op}: slot_mapping must be contiguous")
    for name, t in (
        ("v", v),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        if t.device != k.device:
            raise ValueError(f"{op}: {name} is on {t.device} but k is on {k.device}")


def fill_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens]. Writes the caches in place."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(4096 // block_d, 1))
    _fill_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
