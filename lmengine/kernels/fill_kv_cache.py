"""Write this step's keys and values into the paged KV cache.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. `slot_mapping[t]` is the flat
slot (block_id * block_size + offset) that token t of the packed batch writes to.
"""

from __future__ import annotations

import torch


def fill_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]. In place."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def fill_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(
            f"fill_kv_cache: k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}"
        )
    if k.is_cuda:
        from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

        fill_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    slot_mapping = slot_mapping.long()  # index_copy_ takes int64 only
    # [num_blocks * block_size, num_kv_heads, head_dim] views share the cache storage
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
