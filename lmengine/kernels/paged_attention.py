"""Causal attention of a packed, variable-length batch over the paged KV cache.

One call serves prefill chunks and decode tokens together. Sequence b owns packed query tokens
`[q_start_loc[b], q_start_loc[b] + q_lens[b])`; its keys are the first `kv_lens[b]` cache slots
of its block table, which already hold this step's keys (fill_kv_cache runs first). Query i of
sequence b sits at position `kv_lens[b] - q_lens[b] + i` and sees keys `0..position`.

With `sliding_window=W` query at position p sees only keys `p-W+1..p` (transformers'
`kv_idx > q_idx - W`); with `softcap=c` the scaled scores become `c * tanh(scores / c)` before
masking (Gemma 2). Both are per call, so alternating layers share one AttentionMetadata.

With `sinks` (gpt-oss: one learned float32 logit per query head) the softmax runs over the
visible keys' scores and that logit, which carries no value: out = sum_j exp(s_j) v_j /
(sum_j exp(s_j) + exp(sink)). The sink is not soft-capped, and is seen whatever the window.

Values may be narrower than keys, and may be a view into the key cache: DeepSeek's multi-head
latent attention in its absorbed form is MQA over one latent cache [num_blocks, block_size, 1,
kv_lora_rank + rope_dim] whose values are its first kv_lora_rank elements, passed as the view
`v_cache = k_cache[..., :kv_lora_rank]`. The output then has the values' head dim.

GQA is handled by grouping query heads per KV head, never by repeating the cache. Lengths,
block tables and the CPU gather plans come from `AttentionMetadata`, built once per step
(lmengine.kernels.attention_metadata).

A bfloat16 cache (a bfloat16 model) goes through the same compiled decode kernel, which widens
each block's rows to float32 as it reads them (and the query, rounding the output back); its
prompt chunks go to the bfloat16 form of the compiled prefill kernel (its GEMMs on
the CPU's matrix units) where the CPU has them, else to the gather + SDPA path in bfloat16.

An int8 cache (k_cache.dtype == torch.int8) comes with `k_scale` / `v_scale`,
[num_blocks, block_size, num_kv_heads] float32 (lmengine.kernels.kv_quant): the CPU path
dequantizes the blocks it gathers, the compiled decode kernel and the Triton kernel dequantize
each key and value row as they read it. Its values are as wide as its keys (no latent cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext, cpu_features
from lmengine.kernels.attention_metadata import AttentionMetadata
from lmengine.kernels.kv_quant import dequantize_kv, dequantize_kv_ref


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
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-sequence reference.

    q: [num_tokens, num_heads, head_dim]; k_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; v_cache: [num_blocks, block_size, num_kv_heads, v_head_dim], any strides (int8
    with k_scale, v_scale: [num_blocks, block_size, num_kv_heads]); sinks: [num_heads] or None
    -> [num_tokens, num_heads, v_head_dim].
    """
    if k_scale is not None:
        k_cache = dequantize_kv_ref(k_cache, k_scale)
        v_cache = dequantize_kv_ref(v_cache, v_scale)
    num_tokens, num_heads = q.shape[:2]
    num_kv_heads, bs = k_cache.shape[2], k_cache.shape[1]
    out = q.new_empty(num_tokens, num_heads, v_cache.shape[3])
    for b in range(meta.q_lens.shape[0]):
        start, q_len, kv_len = (int(x[b]) for x in (meta.q_start_loc, meta.q_lens, meta.kv_lens))
        pos = torch.arange(kv_len)
        blocks, offsets = meta.block_tables[b].long()[pos // bs], pos % bs
        k = k_cache[blocks, offsets]  # [kv_len, num_kv_heads, head_dim]
        v = v_cache[blocks, offsets]  # [kv_len, num_kv_heads, v_head_dim]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1).float()
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1).float()
        qb = q[start : start + q_len].transpose(0, 1).float()  # [num_heads, q_len, head_dim]
        scores = qb @ k.transpose(1, 2) * scale  # [num_heads, q_len, kv_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        keys = torch.arange(kv_len)[None, :]
        hidden = keys > q_pos
        if sliding_window is not None:
            hidden |= keys <= q_pos - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            # one more logit per head, then dropped: it only adds to the denominator
            sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out[start : start + q_len] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with the scores in hand, for what SDPA cannot do: `softcap * tanh(scores /
    softcap)`, and a sink logit per row that joins the softmax with no value (its softmax then
    runs in float32). q: [n, kv_heads, rows, d]; k, v: [n, kv_heads, keys, d]; mask: additive,
    broadcastable to [n, kv_heads, rows, keys]; sinks: [kv_heads, rows] float32. v's last
    dim may differ from d."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [n, kv_heads, rows, keys]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v)
    sink = sinks[None, :, :, None].expand(scores.shape[0], -1, -1, 1)  # [n, kv_heads, rows, 1]
    probs = torch.cat([scores.float(), sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


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
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Vectorised CPU path, group by group (decodes, prefills): the compiled kernels where they
    apply, else one padded SDPA call per group (with a sink or a soft cap: the scores
    computed explicitly, _explicit_attention)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_cache.shape[2], v_cache.shape[3]
    # MLA's values are the first elements of its latent keys: gathered once, with the keys
    values_in_keys = _is_prefix_view(v_cache, k_cache)
    group_size = num_heads // num_kv_heads
    out = None
    quantized = k_scale is not None
    kernel = _decode_kernel_for(q.dtype, k_cache.dtype)
    # the int8 cache's kernel takes float32 queries; the float32 and bfloat16 caches' kernels
    # take the cache's dtype (the bfloat16 one widens the query and rounds the result itself)
    widen = q.dtype != torch.float32 and k_cache.dtype == torch.int8
    # the compiled prefill kernel is looked up only for a group of prompt chunks: a decode step
    # never asks for it
    may_prefill = q.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype == q.dtype
    may_prefill = may_prefill and sliding_window is None and softcap is None
    for plan in meta.groups:
        n, max_q = plan.q_index.shape
        if kernel is not None and plan.decode_tables is not None:
            qd = q if plan.is_identity else q[plan.q_index[:, 0]]  # [n, heads, d]
            qd = qd.float() if widen else qd.contiguous()
            tables, kv_lens = plan.decode_tables, plan.decode_kv_lens
            window, cap = sliding_window or 0, softcap or 0.0  # 0: none
            caches = (k_cache, v_cache, k_scale, v_scale) if quantized else (k_cache, v_cache)
            res = kernel(qd, *caches, tables, kv_lens, scale, window, cap, sinks)
            if widen:
                res = res.to(q.dtype)
            if plan.is_identity:
                return res
            if out is None:
                out = q.new_empty(num_tokens, num_heads, v_head_dim)
            out[plan.out_tokens] = res
            continue
        prefill = None
        if may_prefill and plan.prefill_args is not None:
            prefill = prefill_kernel(q.dtype)
        if prefill is not None:
            if out is None:
                out = q.new_empty(num_tokens, num_heads, v_head_dim)
            prefill(q, k_cache, v_cache, *plan.prefill_args, scale, out, sinks)  # writes its rows
            if plan.is_identity:
                return out
            continue
        # [n * max_blocks, bs, kv_heads, d] -> [n, kv_heads, max_blocks * bs, d]
        kg = k_cache.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads, head_dim)
        if values_in_keys:
            vg = kg[..., :v_head_dim]
        else:
            vg = v_cache.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads, v_head_dim)
        if quantized:
            # int8 blocks and their scales [n, max_blocks * bs, kv_heads] -> q's dtype
            ks = k_scale.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads)
            vs = v_scale.index_select(0, plan.kv_blocks).view(n, -1, num_kv_heads)
            kg, vg = dequantize_kv(kg, ks, q.dtype), dequantize_kv(vg, vs, q.dtype)
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
        if plan.is_fresh and sliding_window is None and softcap is None and sinks is None:
            # NOTE: whole prompts, right-padded: top-left causal masking is exact for the real
            # rows, and SDPA then skips the masked half instead of reading a dense mask.
            qf = q[plan.q_index].transpose(1, 2)  # [n, heads, max_q, d]
            res = F.scaled_dot_product_attention(
                qf, kg, vg, is_causal=True, scale=scale, enable_gqa=True
            )
            res = res.transpose(1, 2).reshape(n * max_q, num_heads, v_head_dim)
        else:
            # [n, max_q, kv_heads, g, d] -> [n, kv_heads, g * max_q, d]
            qg = q if plan.is_identity else q[plan.q_index]
            qg = qg.view(n, max_q, num_kv_heads, group_size, head_dim)
            qg = qg.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group_size * max_q, head_dim)
            mask = plan.mask_for(group_size, q.dtype, sliding_window)
            if softcap is None and sinks is None:
                res = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            else:
                # rows ordered (head in group, query), as qg's
                row_sinks = None
                if sinks is not None:
                    row_sinks = sinks.view(num_kv_heads, group_size, 1).expand(-1, -1, max_q)
                    row_sinks = row_sinks.reshape(num_kv_heads, group_size * max_q)
                res = _explicit_attention(qg, kg, vg, mask, scale, softcap, row_sinks)
            # [n, kv_heads, g, max_q, dv] -> [n * max_q, heads, dv]
            res = res.view(n, num_kv_heads, group_size, max_q, v_head_dim)
            res = res.permute(0, 3, 1, 2, 4).reshape(n * max_q, num_heads, v_head_dim)
        if plan.is_identity:
            return res
        if out is None:
            out = q.new_empty(num_tokens, num_heads, v_head_dim)
        out[plan.out_tokens] = res if max_q == 1 else res[plan.out_rows]
    return out


def _is_prefix_view(v_cache: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether v_cache is k_cache[..., :v_head_dim] (one latent cache, MLA)."""
    return (
        v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.dtype == k_cache.dtype
        and v_cache.shape[:3] == k_cache.shape[:3]
        and v_cache.stride() == k_cache.stride()
    )


def _decode_kernel_for(q_dtype: torch.dtype, cache_dtype: torch.dtype):
    """The compiled gather-free decode kernel for these dtypes, or None (then decodes use the
    SDPA path). Each computes in float32: a bfloat16 query is widened and the result rounded
    back (by the bfloat16 cache's kernel itself, around the int8 one); a bfloat16 or int8 cache
    is widened block by block as it is read."""
    module = cpu_ext.load()
    if module is None or q_dtype not in (torch.float32, torch.bfloat16):
        return None
    if cache_dtype == torch.int8:
        return module.paged_decode_attention_int8
    if cache_dtype == q_dtype:
        if q_dtype == torch.float32:
            return module.paged_decode_attention
        return module.paged_decode_attention_bf16
    return None


def prefill_kernel(dtype: torch.dtype):
    """The compiled prefill kernel (causal prompt chunks, reading the cache in place), or None
    (then prompts use the gather + SDPA path). It runs on oneDNN's GEMM microkernel, which is
    compiled for the CPU's ISA on Intel and AMD alike; the module offers it where it was built
    for AVX-512 (its 16-float vector code is slow in an AVX2 build). Its bfloat16 form runs
    its GEMMs on the matrix units, so it is taken only where the CPU has them."""
    module = cpu_ext.load()
    if module is None or not module.prefill_attention_available():
        return None
    if dtype == torch.float32:
        return module.paged_prefill_attention
    return module.paged_prefill_attention_bf16 if cpu_features.has_bf16_units() else None


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
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, v_head_dim].

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; v_cache: [num_blocks,
    block_size, num_kv_heads, v_head_dim], v_head_dim <= head_dim, its own cache or (MLA) the
    view k_cache[..., :v_head_dim].
    `sliding_window` (keys per query, >= 1) and `softcap` (> 0) are optional; None = off.
    An int8 cache needs `k_scale` and `v_scale` ([num_blocks, block_size, num_kv_heads]).
    `sinks`: [num_heads] learned logits (gpt-oss), any float dtype, used as float32."""
    if (k_cache.dtype == torch.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("paged_attention: an int8 cache needs k_scale and v_scale, and only it")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            "paged_attention: k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, "
            f"head_dim] alike, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3] or v_cache.shape[3] > k_cache.shape[3]:
        raise ValueError(
            f"paged_attention: head dims q {q.shape[2]}, k {k_cache.shape[3]}, v "
            f"{v_cache.shape[3]}: q's must equal k's, and v's must not exceed it"
        )
    if k_cache.dtype == torch.int8 and v_cache.shape[3] != k_cache.shape[3]:
        raise ValueError(
            "paged_attention: an int8 cache stores values as wide as keys; a latent (MLA) cache "
            f"with {v_cache.shape[3]}-wide values in {k_cache.shape[3]}-wide keys needs a "
            "float cache"
        )
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"paged_attention: {q.shape[1]} query heads not a multiple of "
            f"{k_cache.shape[2]} KV heads"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"paged_attention: sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"paged_attention: softcap must be > 0, got {softcap}")
    if sinks is not None:
        if sinks.shape != (q.shape[1],) or not sinks.is_floating_point():
            raise ValueError(
                f"paged_attention: sinks must be one float logit per query head, "
                f"[{q.shape[1]}], got {sinks.dtype} {tuple(sinks.shape)}"
            )
        if sinks.device != q.device:
            raise ValueError(f"paged_attention: sinks are on {sinks.device}, q on {q.device}")
        sinks = sinks.to(torch.float32).contiguous()  # NOTE: no copy when already so
    if q.is_cuda:
        from lmengine.kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_scale, v_scale, sinks=sinks
        )
    if not meta.groups:
        raise ValueError("paged_attention: metadata was built for another device than the CPU")
    return paged_attention_cpu(
        q, k_cache, v_cache, meta, scale, sliding_window, softcap, k_scale, v_scale, sinks=sinks
    )
