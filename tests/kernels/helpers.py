"""Builders for paged-cache kernel tests: a dense reference scattered into a permuted block pool."""

from __future__ import annotations

import torch

from lmengine.kernels import AttentionMetadata


def make_paged_batch(
    q_lens: list[int],
    kv_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
):
    """Random q and a KV cache whose blocks are handed out in a random permutation.

    Returns (q [sum(q_lens), heads, dim], k_cache, v_cache, meta, dense_k, dense_v) where
    dense_k[b] is [kv_lens[b], kv_heads, dim], the keys sequence b must see.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few spare blocks that nobody owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # garbage outside owned slots
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    block_tables, dense_k, dense_v = [], [], []
    for n, nb in zip(kv_lens, blocks_per_seq):
        table, perm = perm[:nb], perm[nb:]
        block_tables.append(table)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for j in range(n):
            k_cache[table[j // block_size], j % block_size] = k[j]
            v_cache[table[j // block_size], j % block_size] = v[j]
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(block_tables, q_lens, kv_lens, block_size, device)
    return q, k_cache, v_cache, meta, dense_k, dense_v


def make_latent_batch(
    q_lens: list[int],
    kv_lens: list[int],
    num_heads: int,
    head_dim: int,
    v_head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """make_paged_batch for one latent cache (DeepSeek's MLA, absorbed form): one KV head of
    head_dim, whose values are the first v_head_dim elements of its keys. v_cache is the view
    k_cache[..., :v_head_dim] (non-contiguous), dense_v[b] the same slice of dense_k[b]."""
    q, k_cache, _, meta, dense_k, _ = make_paged_batch(
        q_lens, kv_lens, num_heads, 1, head_dim, block_size, dtype, seed
    )
    v_cache = k_cache[..., :v_head_dim]  # [num_blocks, block_size, 1, v_head_dim]
    return q, k_cache, v_cache, meta, dense_k, [k[..., :v_head_dim] for k in dense_k]


def dense_causal_attention(
    q, dense_k, dense_v, q_lens, kv_lens, scale, sliding_window=None, softcap=None, sinks=None
):
    """Independent dense reference: per sequence, plain softmax attention in float64; a query
    at position p sees keys (p - sliding_window, p]; scores are soft-capped before masking. A
    sink (sinks: [heads]) adds exp(sink) to each head's softmax denominator."""
    out, start = [], 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qb = q[start : start + ql].double()
        start += ql
        groups = qb.shape[1] // dense_k[b].shape[1]
        k = dense_k[b].double().repeat_interleave(groups, dim=1)
        v = dense_v[b].double().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(kl - ql, kl)[:, None]
        visible = torch.arange(kl)[None, :] <= pos
        if sliding_window is not None:
            visible &= torch.arange(kl)[None, :] > pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.double()[:, None, None]  # [heads, 1, 1]
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            weights = (scores - top).exp()
            probs = weights / (weights.sum(-1, keepdim=True) + (sink - top).exp())
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(out)
