"""Write this step's keys and values into the paged KV cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. `slot_mapping[t]` is the flat
slot (block_id * block_size + offset) that token t of the packed batch writes to.

With an int8 cache (kv_cache_dtype="int8") the keys and values are quantized on the way in
(lmengine.kernels.kv_quant) and their scales, [num_blocks, block_size, num_kv_heads] float32,
are written to `k_scale` / `v_scale` at the same slots.
"""

from __future__ import annotations

import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.kv_quant import quantize_kv_ref


def fill_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]. In place."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        b, o = slot // block_size, slot % block_size
        if k_scale is None:
            k_cache[b, o] = k[t]
            v_cache[b, o] = v[t]
        else:
            k_cache[b, o], k_scale[b, o] = quantize_kv_ref(k[t])
            v_cache[b, o], v_scale[b, o] = quantize_kv_ref(v[t])


def fill_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(
            f"fill_kv_cache: k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}"
        )
    quantized = k_cache.dtype == torch.int8
    if quantized != (k_scale is not None and v_scale is not None):
        raise ValueError("fill_kv_cache: an int8 cache needs k_scale and v_scale, and only it")
    if k.is_cuda:
        from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

        fill_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    slot_mapping = slot_mapping.long()  # index_copy_ takes int64 only
    if quantized:
        for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            xq, xs = quantize_kv_ref(x)  # vectorised over every token and head
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, xq)
            scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, xs)
        return
    # [num_blocks * block_size, num_kv_heads, head_dim] views share the cache storage
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def rotary_fill_kv_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor | None:
    """Rotary on q and k fused with the cache write, in one compiled call (csrc/rotary_ops.cpp;
    bit-identical to `apply_rotary` then `fill_kv_cache`). q: [T, heads * head_dim], k, v:
    [T, kv_heads * head_dim], rows contiguous (column slices of a fused qkv output are fine);
    cos, sin: [T, head_dim]. Returns the rotated q [T, heads, head_dim], or None when the
    fused path does not apply (not float32 or bfloat16 CPU tensors of one dtype, or no
    compiled kernels): then the caller runs the two steps itself.

    In bfloat16 (csrc/bf16_ops.cpp) each product and their sum are rounded to bfloat16 where
    transformers' eager bfloat16 ops round them: bit-identical to the reference too."""
    dtype = q.dtype
    if q.is_cuda or dtype not in (torch.float32, torch.bfloat16):
        return None
    if any(t.dtype != dtype for t in (k, v, cos, sin, k_cache, v_cache)):
        return None
    ext = cpu_ext.load()
    if ext is None or cos.shape[-1] != k_cache.shape[-1]:
        return None
    if not all(t.dim() == 2 and t.stride(-1) == 1 for t in (q, k, v)):
        return None
    kernel = ext.rotary_fill_kv if dtype == torch.float32 else ext.rotary_fill_kv_bf16
    return kernel(q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slot_mapping)
