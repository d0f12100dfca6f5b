"""Causal attention of a packed, variable-length batch over the paged KV cache.

One call serves prefill chunks and decode tokens together. Sequence b owns packed query tokens
`[q_start_loc[b], q_start_loc[b] + q_lens[b])`; its keys are the first `kv_lens[b]` cache slots
of its block table, which already hold this step's keys (fill_kv_cache runs first). Query i of
sequence b sits at position `kv_lens[b] - q_lens[b] + i` and sees keys `0..position`.

With `sliding_window=W` query at position p sees only keys `p-W+1..p` (transformers'
`kv_idx > q_idx - W`); with `softcap=c` the scaled scores become `c * tanh(scores / c)` before
masking (Gemma 2). Both are per call, so alternating layers share one AttentionMetadata.

GQA is handled by grouping query heads per KV head, never by repeating the cache.

An int8 cache (k_cache.dtype == torch.int8) comes with `k_scale` / `v_scale`,
[num_blocks, block_size, num_kv_heads] float32 (lmengine.kernels.kv_quant): the CPU path
dequantizes the blocks it gathers, the compiled decode kernel and the Triton kernel dequantize
each key and value row as they read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext
from lmengine.kernels.kv_quant import dequantize_kv, dequantize_kv_ref


@dataclass
class _GroupPlan:
    """Padded gather indices for a group of sequences (all decodes, or all prefills)."""

    q_index: torch.Tensor  # [num_seqs, max_q] packed token per query row (padding repeats)
    kv_blocks: torch.Tensor  # [num_seqs * max_blocks] block ids, row-major (padding -> 0)
    last_visible: torch.Tensor  # [num_seqs, max_q] position of each query row (last key seen)
    is_identity: bool  # the group is every packed token, one per sequence, in order
    is_fresh: bool  # prefills with no cached history: plain causal attention applies
    out_rows: torch.Tensor  # [num_valid] rows of the flattened [num_seqs * max_q] result
    out_tokens: torch.Tensor  # [num_valid] packed token index each valid row goes to
    num_keys: int  # max_blocks * block_size: key slots gathered per sequence
    # additive masks per (group size, dtype, window); fresh prompts without window or cap
    # need none: the causal SDPA path serves them
    tiled_masks: dict[tuple, torch.Tensor] = field(default_factory=dict)
    # decode groups only, for the compiled kernel that reads the cache without a gather:
    decode_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    decode_kv_lens: torch.Tensor | None = None  # [num_seqs] int32

    def mask_for(
        self, group_size: int, dtype: torch.dtype, sliding_window: int | None = None
    ) -> torch.Tensor:
        """Additive mask (0 or -inf) for query rows ordered (head-in-group, query):
        [num_seqs, 1, g * max_q, max_kv]. Built once per step and window, not once per layer:
        SDPA would otherwise convert a boolean mask in every call."""
        key = (group_size, dtype, sliding_window)
        if key not in self.tiled_masks:
            mask = self.visible(sliding_window)
            additive = torch.zeros(mask.shape, dtype=dtype)
            additive.masked_fill_(~mask, float("-inf"))
            self.tiled_masks[key] = additive.repeat(1, 1, group_size, 1)
        return self.tiled_masks[key]

    def visible(self, sliding_window: int | None) -> torch.Tensor:
        """[num_seqs, 1, max_q, max_kv] bool: key j is visible to a row at position p iff
        j <= p (and j > p - sliding_window)."""
        keys = torch.arange(self.num_keys)[None, None, :]
        last = self.last_visible[:, :, None]
        mask = keys <= last
        if sliding_window is not None:
            mask &= keys > last - sliding_window
        return mask[:, None]


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per step and shared by every layer."""

    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    q_start_loc: torch.Tensor  # [num_seqs] int32, first packed token of each sequence
    q_lens: torch.Tensor  # [num_seqs] int32, tokens computed this step
    kv_lens: torch.Tensor  # [num_seqs] int32, cached tokens after this step's fill
    max_q_len: int
    max_kv_len: int
    block_size: int
    groups: list[_GroupPlan] = field(default_factory=list)  # CPU path only

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        q_lens: list[int],
        kv_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        kv_token_bytes: int = 0,
    ) -> AttentionMetadata:
        """`kv_token_bytes` (K + V bytes of one token in one layer) lets the CPU plan split
        a group so that the KV it gathers stays in the last-level cache."""
        num_seqs = len(q_lens)
        width = max(len(t) for t in block_tables)
        table = torch.zeros(num_seqs, width, dtype=torch.int32)
        for b, t in enumerate(block_tables):
            table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32)
        q_start = torch.zeros(num_seqs, dtype=torch.int32)
        q_start[1:] = torch.cumsum(q_lens_t, 0)[:-1]
        meta = cls(
            block_tables=table,
            q_start_loc=q_start,
            q_lens=q_lens_t,
            kv_lens=kv_lens_t,
            max_q_len=max(q_lens),
            max_kv_len=max(kv_lens),
            block_size=block_size,
        )
        if torch.device(device).type == "cpu":
            is_decode = q_lens_t == 1
            is_fresh = ~is_decode & (kv_lens_t == q_lens_t)
            for sel in (is_decode, is_fresh, ~is_decode & ~is_fresh):
                seqs = sel.nonzero().flatten()
                # NOTE: the compiled decode kernel gathers nothing, so needs no cache budget
                budget = 0 if sel is is_decode and _decode_kernel() else kv_token_bytes
                for chunk in _cache_sized_chunks(seqs, kv_lens_t, block_size, budget):
                    meta.groups.append(_plan_group(meta, chunk))
        else:
            for name in ("block_tables", "q_start_loc", "q_lens", "kv_lens"):
                setattr(meta, name, getattr(meta, name).to(device, non_blocking=True))
        return meta


# NOTE: measured on a 36 MB L3: gathering 31 MB of K/V for 64 decodes at once made attention
# 2.8x slower than four gathers of 8 MB; 16 MB groups lose nothing at shorter contexts.
_GATHER_BUDGET_BYTES = 16 << 20


def _cache_sized_chunks(
    seqs: torch.Tensor, kv_lens: torch.Tensor, block_size: int, kv_token_bytes: int
) -> list[torch.Tensor]:
    """Split `seqs` into runs whose padded gathered K/V fits the budget."""
    if seqs.numel() == 0:
        return []
    if kv_token_bytes <= 0:
        return [seqs]
    max_tokens = (int(kv_lens[seqs].max()) + block_size - 1) // block_size * block_size
    per_chunk = max(1, _GATHER_BUDGET_BYTES // (max_tokens * kv_token_bytes))
    return list(seqs.split(per_chunk))


def _plan_group(meta: AttentionMetadata, seqs: torch.Tensor) -> _GroupPlan:
    bs = meta.block_size
    q_lens = meta.q_lens[seqs].long()  # [n]
    kv_lens = meta.kv_lens[seqs].long()  # [n]
    max_q = int(q_lens.max())
    max_blocks = (int(kv_lens.max()) + bs - 1) // bs
    rows = torch.arange(max_q)
    row_clamped = torch.minimum(rows[None, :], q_lens[:, None] - 1)  # [n, max_q]
    q_index = meta.q_start_loc[seqs].long()[:, None] + row_clamped
    # NOTE: whole blocks are gathered (one contiguous copy each, much faster than per slot);
    # the slots past kv_len are masked out.
    kv_blocks = meta.block_tables[seqs, :max_blocks].long()  # [n, max_blocks]
    is_fresh = max_q > 1 and bool((kv_lens == q_lens).all())
    # key j is visible to query i iff j <= position(i); padded rows repeat the last real row
    last_visible = (kv_lens - q_lens)[:, None] + row_clamped  # [n, max_q]
    valid = (rows[None, :] < q_lens[:, None]).flatten()
    out_rows = valid.nonzero().flatten()
    out_tokens = q_index.flatten()[out_rows]
    num_tokens = int(meta.q_lens.sum())
    is_identity = max_q == 1 and len(seqs) == num_tokens
    decode_tables = decode_kv_lens = None
    if max_q == 1:
        decode_tables = meta.block_tables[seqs, :max_blocks].contiguous()
        decode_kv_lens = meta.kv_lens[seqs].contiguous()
    return _GroupPlan(
        decode_tables=decode_tables,
        decode_kv_lens=decode_kv_lens,
        q_index=q_index,
        kv_blocks=kv_blocks.flatten(),
        last_visible=last_visible,
        num_keys=max_blocks * bs,
        out_rows=out_rows,
        out_tokens=out_tokens,
        is_identity=is_identity,
        is_fresh=is_fresh,
    )


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-sequence reference.

    q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (int8 with k_scale, v_scale: [num_blocks, block_size,
    num_kv_heads]) -> [num_tokens, num_heads, head_dim].
    """
    if k_scale is not None:
        k_cache = dequantize_kv_ref(k_cache, k_scale)
        v_cache = dequantize_kv_ref(v_cache, v_scale)
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    for b in range(meta.q_lens.shape[0]):
        start, q_len, kv_len = (int(x[b]) for x in (meta.q_start_loc, meta.q_lens, meta.kv_lens))
        slots = [int(meta.block_tables[b, j // bs]) * bs + j % bs for j in range(kv_len)]
        k = k_cache.view(-1, *k_cache.shape[2:])[slots]  # [kv_len, num_kv_heads, head_dim]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1).float()
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1).float()
        qb = q[start : start + q_len].transpose(0, 1).float()  # [num_heads, q_len, head_dim]
        scores = qb @ k.transpose(1, 2) * scale  # [num_heads, q_len, kv_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        keys = torch.arange(kv_len)[None, :]
        hidden = keys > pos
        if sliding_window is not None:
            hidden |= keys <= pos - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(-1)
        out[start : start + q_len] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA with `softcap * tanh(scores / softcap)` (SDPA itself cannot cap).
    q: [n, kv_heads, rows, d]; k, v: [n, kv_heads, keys, d]; mask: additive, broadcastable
    to [n, kv_heads, rows, keys]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [n, kv_heads, rows, keys]
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(scores.softmax(-1), v)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Vectorised CPU path: one padded SDPA call per group (decodes, prefills)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = None
    quantized = k_scale is not None
    kernel = None
    if q.dtype == torch.float32:
        kernel = _decode_kernel_int8() if quantized else _decode_kernel()
    for plan in meta.groups:
        n, max_q = plan.q_index.shape
        if kernel is not None and plan.decode_tables is not None:
            qd = q if plan.is_identity else q[plan.q_index[:, 0]]  # [n, heads, d]
            tables, kv_lens = plan.decode_tables, plan.decode_kv_lens
            window, cap = sliding_window or 0, softcap or 0.0  # 0: none
            if quantized:
                caches = (k_cache, v_cache, k_scale, v_scale)
                res = kernel(qd.contiguous(), *caches, tables, kv_lens, scale, window, cap)
            else:
                res = kernel(qd.contiguous(), k_cache, v_cache, tables, kv_lens, scale, window, cap)
            if plan.is_identity:
                return res
            if out is None:
                out = torch.empty_like(q)
            out[plan.out_tokens] = res
            continue
        # [n * max_blocks, bs, kv_heads, d] -> [n, kv_heads, max_blocks * bs, d]
        kg = k_cache.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads, head_dim)
        vg = v_cache.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads, head_dim)
        if quantized:
            # int8 blocks and their scales [n, max_blocks * bs, kv_heads] -> q's dtype
            ks = k_scale.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads)
            vs = v_scale.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads)
            kg, vg = dequantize_kv(kg, ks, q.dtype), dequantize_kv(vg, vs, q.dtype)
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
        if plan.is_fresh and sliding_window is None and softcap is None:
            # NOTE: whole prompts, right-padded: top-left causal masking is exact for the real
            # rows, and SDPA then skips the masked half instead of reading a dense mask.
            qf = q[plan.q_index].transpose(1, 2)  # [n, heads, max_q, d]
            res = F.scaled_dot_product_attention(
                qf, kg, vg, is_causal=True, scale=scale, enable_gqa=True
            )
            res = res.transpose(1, 2).reshape(n * max_q, num_heads, head_dim)
        else:
            # [n, max_q, kv_heads, g, d] -> [n, kv_heads, g * max_q, d]
            qg = q if plan.is_identity else q[plan.q_index]
            qg = qg.view(n, max_q, num_kv_heads, group_size, head_dim)
            qg = qg.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group_size * max_q, head_dim)
            mask = plan.mask_for(group_size, q.dtype, sliding_window)
            if softcap is None:
                res = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            else:
                res = _softcapped_attention(qg, kg, vg, mask, scale, softcap)
            # [n, kv_heads, g, max_q, d] -> [n * max_q, heads, d]
            res = res.view(n, num_kv_heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
            res = res.reshape(n * max_q, num_heads, head_dim)
        if plan.is_identity:
            return res
        if out is None:
            out = torch.empty_like(q)
        out[plan.out_tokens] = res if max_q == 1 else res[plan.out_rows]
    return out


def _decode_kernel():
    """The compiled gather-free decode kernel, or None (then decodes use the SDPA path)."""
    module = cpu_ext.load()
    return None if module is None else module.paged_decode_attention


def _decode_kernel_int8():
    """Its int8-cache variant (dequantizes block by block as it reads), or None."""
    module = cpu_ext.load()
    return None if module is None else getattr(module, "paged_decode_attention_int8", None)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    `sliding_window` (keys per query, >= 1) and `softcap` (> 0) are optional; None = off.
    An int8 cache needs `k_scale` and `v_scale` ([num_blocks, block_size, num_kv_heads])."""
    if (k_cache.dtype == torch.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("paged_attention: an int8 cache needs k_scale and v_scale, and only it")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"paged_attention: {q.shape[1]} query heads not a multiple of "
            f"{k_cache.shape[2]} KV heads"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"paged_attention: sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"paged_attention: softcap must be > 0, got {softcap}")
    if q.is_cuda:
        from lmengine.kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_scale, v_scale
        )
    if not meta.groups:
        raise ValueError("paged_attention: metadata was built for another device than the CPU")
    return paged_attention_cpu(
        q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_scale, v_scale
    )
