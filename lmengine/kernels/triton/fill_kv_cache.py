"""Triton write of this step's keys and values into the paged KV cache, in place.

k, v: [num_tokens, num_kv_heads, head_dim] (any token and head strides, contiguous last dim);
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (any block, slot and head
strides, contiguous last dim, so per-layer views of a larger pool work). slot_mapping:
[num_tokens] int64 or int32 flat slots, block_id * block_size + offset. One program copies one
token's [num_kv_heads, head_dim] keys and values. A negative slot marks a padding token and is
skipped (nothing is written); slots are otherwise not bounds-checked on the device.

With an int8 cache the program quantizes each (token, KV head) row as kv_quant.quantize_kv_ref
does (scale = absmax / 127) and writes the float32 scales to k_scale / v_scale,
[num_blocks, block_size, num_kv_heads]. Rounding is half away from zero (torch.round rounds
half to even): the two differ only on exact .5 ties, by one quantum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _quantize_rows(x):
    """x: [BLOCK_H, BLOCK_D] float32 (masked lanes 0) -> (int8 rows, float32 scales [BLOCK_H])."""
    scale = tl.max(tl.abs(x), axis=1) / 127.0  # [BLOCK_H]
    safe = tl.where(scale > 0.0, scale, 1.0)
    y = x / safe[:, None]
    y = tl.where(y >= 0.0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))  # half away from zero
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return y.to(tl.int8), scale


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
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    v_scale_ptr,
    stride_ks_b,
    stride_ks_s,
    stride_vs_b,
    stride_vs_s,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,  # int8 cache: quantize and write the scales
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
        k = tl.load(k_src + heads[:, None] * stride_k_h + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_src + heads[:, None] * stride_v_h + offs_d[None, :], mask=mask, other=0.0)
        if QUANT:
            mask_h = heads < tl.where(slot >= 0, num_kv_heads, 0)  # [BLOCK_H]
            ks_dst = k_scale_ptr + block * stride_ks_b + offset * stride_ks_s + heads
            vs_dst = v_scale_ptr + block * stride_vs_b + offset * stride_vs_s + heads
            k, k_s = _quantize_rows(k.to(tl.float32))
            v, v_s = _quantize_rows(v.to(tl.float32))
            tl.store(ks_dst, k_s, mask=mask_h)
            tl.store(vs_dst, v_s, mask=mask_h)
        tl.store(k_dst + heads[:, None] * stride_k_cache_h + offs_d[None, :], k, mask=mask)
        tl.store(v_dst + heads[:, None] * stride_v_cache_h + offs_d[None, :], v, mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
    if v.dtype != k.dtype:
        raise ValueError(f"{op}: v dtype {v.dtype} differs from k dtype {k.dtype}")
    cache_dtype = torch.int8 if k_scale is not None else k.dtype
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != cache_dtype:
            raise ValueError(
                f"{op}: {name} dtype {t.dtype} differs from k dtype {k.dtype}"
                if k_scale is None
                else f"{op}: {name} must be int8 with k_scale/v_scale, got {t.dtype}"
            )
    if k_scale is not None:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None or t.dtype != torch.float32 or t.shape != k_cache.shape[:3]:
                raise ValueError(
                    f"{op}: {name} must be float32 {tuple(k_cache.shape[:3])}, got "
                    f"{None if t is None else (t.dtype, tuple(t.shape))}"
                )
            if t.stride(-1) != 1 or t.device != k.device:
                raise ValueError(f"{op}: {name} must be on {k.device} with contiguous heads")
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (int8 with k_scale, v_scale: [num_blocks, block_size,
    num_kv_heads] float32); slot_mapping: [num_tokens]. Writes the caches in place."""
    _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    quant = k_scale is not None
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
        k_scale if quant else k_cache,  # NOTE: unused pointers when not QUANT
        v_scale if quant else v_cache,
        k_scale.stride(0) if quant else 0,
        k_scale.stride(1) if quant else 0,
        v_scale.stride(0) if quant else 0,
        v_scale.stride(1) if quant else 0,
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANT=quant,
        num_warps=4,
    )
