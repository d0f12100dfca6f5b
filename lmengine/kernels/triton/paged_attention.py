"""Triton varlen causal attention over the paged KV cache (prefill chunks and decode together).

Layouts: q, out: [num_tokens, num_heads, head_dim] packed over sequences; k_cache, v_cache:
[num_blocks, block_size, num_kv_heads, head_dim]; per-sequence metadata from AttentionMetadata
(block_tables [num_seqs, max_blocks] int32, q_start_loc / q_lens / kv_lens [num_seqs] int32).
Query i of sequence b sits at position kv_lens[b] - q_lens[b] + i and sees keys 0..position
(with a sliding window W: only keys position-W+1..position, and the key loop starts there).
An optional soft cap c turns the scaled scores into c * tanh(scores / c) before masking.

Grid: (sequence, query block, kv head). A program owns BLOCK_Q consecutive queries of one
sequence and the GROUP_SIZE query heads that share one KV head, packed as the BLOCK_M rows of
one tile (row = query * GROUP_SIZE + head in group), so each K/V tile read through the block
table serves the whole GQA group; a decode step fills GROUP_SIZE rows instead of one. It loops
over keys in tiles of BLOCK_N with an online (flash-attention) softmax in float32; QK^T and PV
use tl.dot. head_dim is padded to the power of two HEAD_DIM (>= 16) with masks.

Values may be narrower than keys (v_head_dim <= head_dim) and may be a view into the key cache
(DeepSeek's MLA, absorbed: one latent cache of kv_lora_rank + rope_dim, its first kv_lora_rank
elements the values). HEAD_DIM then pads v_head_dim: the first v_head_dim elements of q and k
are one dot, the rest (the rope part, padded to HEAD_DIM_EXTRA) a second dot added to the
scores, so 576 = 512 + 64 is not padded to 1024.

With an int8 cache (QUANT) each K and V tile is loaded as int8 with its per-(slot, KV head)
float32 scales from k_scale / v_scale, [num_blocks, block_size, num_kv_heads], and dequantized
to q's dtype in registers before the dots.

With learned sinks (HAS_SINKS: gpt-oss, one float32 logit per query head) each row's running
max and sum start from its head's sink, as if it were one more key with a zero value, the way
flash-attention kernels with sinks do: m = sink, l = exp(sink - m) = 1, acc = 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmengine.kernels.attention_metadata import AttentionMetadata

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, v_head_dim]
    out_ptr,  # [num_tokens, num_heads, v_head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    q_start_loc_ptr,  # [num_seqs] int32
    q_lens_ptr,  # [num_seqs] int32
    kv_lens_ptr,  # [num_seqs] int32
    sm_scale,  # softmax scale; scores are then multiplied by log2(e) and exponentiated with exp2
    softcap,  # soft cap c (used when HAS_SOFTCAP)
    sliding_window,  # keys per query (used when HAS_WINDOW)
    stride_q_t,
    stride_q_h,
    stride_k_cache_b,
    stride_k_cache_s,
    stride_k_cache_h,
    stride_v_cache_b,
    stride_v_cache_s,
    stride_v_cache_h,
    stride_out_t,
    stride_out_h,
    stride_block_tables_b,
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    v_scale_ptr,
    stride_ks_b,
    stride_ks_s,
    stride_vs_b,
    stride_vs_s,
    sinks_ptr,  # [num_heads] float32 (HAS_SINKS only)
    head_dim,  # of q and k
    v_head_dim,  # of v and out, <= head_dim
    PAGE_SIZE: tl.constexpr,  # cache block size (tokens per block)
    GROUP_SIZE: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # queries per program, BLOCK_M // GROUP_SIZE
    BLOCK_M: tl.constexpr,  # rows of the query tile
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,  # v_head_dim padded to a power of two >= 16
    HEAD_DIM_EXTRA: tl.constexpr,  # head_dim - v_head_dim padded likewise; 0 when equal
    IEEE_DOT: tl.constexpr,  # float32 inputs: full-precision dot instead of tf32
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,  # int8 cache with scales
    HAS_SINKS: tl.constexpr,  # a learned logit per query head joins the softmax
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_len = tl.load(q_lens_ptr + seq)
    q_first = q_block * BLOCK_Q  # first query (index within the sequence) of this program
    if q_first >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    q_start = tl.load(q_start_loc_ptr + seq)
    history = kv_len - q_len  # cached keys before this step's first query

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_first + offs_m // GROUP_SIZE  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M] query head
    row_valid = (offs_m < BLOCK_Q * GROUP_SIZE) & (q_idx < q_len)  # [BLOCK_M]
    q_pos = history + q_idx  # [BLOCK_M] position of each row's query; it sees keys <= q_pos
    token = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] packed token index
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    d_valid = offs_d < v_head_dim  # [HEAD_DIM]

    q_mask = row_valid[:, None] & d_valid[None, :]  # [BLOCK_M, HEAD_DIM]
    q_rows = q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h  # [BLOCK_M, 1]
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_DIM]
    if HEAD_DIM_EXTRA > 0:
        offs_e = v_head_dim + tl.arange(0, HEAD_DIM_EXTRA)  # [HEAD_DIM_EXTRA]
        e_valid = offs_e < head_dim  # [HEAD_DIM_EXTRA]
        q_e_mask = row_valid[:, None] & e_valid[None, :]
        q_e = tl.load(q_rows + offs_e[None, :], mask=q_e_mask, other=0.0)  # [BLOCK_M, EXTRA]

    # running max (finite start so fully masked padding rows never produce NaN), sum, output
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # [BLOCK_M], log2 units as s
        m_i = tl.maximum(sink, -1.0e30)  # [BLOCK_M]
        l_i = tl.exp2(sink - m_i)  # [BLOCK_M] 1, or 0 for a sink of -inf
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # [BLOCK_M]
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # [BLOCK_M, HEAD_DIM]

    # keys past the last query of this program are invisible to every row
    kv_end = tl.minimum(kv_len, history + q_first + BLOCK_Q)
    kv_begin = 0
    if HAS_WINDOW:
        # keys before the first row's window are invisible to every row
        kv_begin = tl.maximum(history + q_first - sliding_window + 1, 0)
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_b
    k_head_ptr = k_cache_ptr + kv_head * stride_k_cache_h
    v_head_ptr = v_cache_ptr + kv_head * stride_v_cache_h
    for start_n in range(kv_begin, kv_end, BLOCK_N):
        kv_idx = start_n + offs_n  # [BLOCK_N] key position
        kv_valid = kv_idx < kv_end  # [BLOCK_N]
        page = tl.load(table_ptr + kv_idx // PAGE_SIZE, mask=kv_valid, other=0).to(tl.int64)
        in_page = kv_idx % PAGE_SIZE  # [BLOCK_N]

        k_offs = page * stride_k_cache_b + in_page * stride_k_cache_s  # [BLOCK_N]
        k_mask = d_valid[:, None] & kv_valid[None, :]  # [HEAD_DIM, BLOCK_N]
        k = tl.load(k_head_ptr + k_offs[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        # k: [HEAD_DIM, BLOCK_N]
        if QUANT:
            ks_offs = page * stride_ks_b + in_page * stride_ks_s + kv_head  # [BLOCK_N]
            k_s = tl.load(k_scale_ptr + ks_offs, mask=kv_valid, other=0.0)  # [BLOCK_N]
            k = (k.to(tl.float32) * k_s[None, :]).to(q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        else:
            s = tl.dot(q, k)
        if HEAD_DIM_EXTRA > 0:
            # the keys' elements past the values' (MLA's rope part): a second dot. NOTE: never
            # with QUANT (_check: an int8 cache's values are as wide as its keys)
            k_e_mask = e_valid[:, None] & kv_valid[None, :]  # [HEAD_DIM_EXTRA, BLOCK_N]
            k_e = tl.load(k_head_ptr + k_offs[None, :] + offs_e[:, None], mask=k_e_mask, other=0.0)
            if IEEE_DOT:
                s += tl.dot(q_e, k_e, input_precision="ieee")
            else:
                s += tl.dot(q_e, k_e)
        s = s * sm_scale
        if HAS_SOFTCAP:
            # c * tanh(s / c), with tanh(x) = 1 - 2 / (exp(2x) + 1) (saturates cleanly)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = kv_valid[None, :] & (kv_idx[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        if HAS_WINDOW:
            visible = visible & (kv_idx[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescales the old sum and accumulator
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_offs = page * stride_v_cache_b + in_page * stride_v_cache_s  # [BLOCK_N]
        v_mask = kv_valid[:, None] & d_valid[None, :]  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_head_ptr + v_offs[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        # v: [BLOCK_N, HEAD_DIM]
        if QUANT:
            vs_offs = page * stride_vs_b + in_page * stride_vs_s + kv_head  # [BLOCK_N]
            v_s = tl.load(v_scale_ptr + vs_offs, mask=kv_valid, other=0.0)  # [BLOCK_N]
            v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        if IEEE_DOT:
            pv = tl.dot(p, v, input_precision="ieee")  # [BLOCK_M, HEAD_DIM]
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows only; every real row sees itself
    out = acc / l_safe[:, None]  # [BLOCK_M, HEAD_DIM]
    out_ptrs = (
        out_ptr + token[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :]
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    op = "paged_attention_triton"
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if (
        k_cache.dim() != 4
        or v_cache.dim() != 4
        or v_cache.shape[:3] != k_cache.shape[:3]
        or v_cache.shape[3] > k_cache.shape[3]
    ):
        raise ValueError(
            f"{op}: k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], values no wider than keys, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{op}: cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{op}: {num_heads} query heads not a multiple of {num_kv_heads} KV heads")
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(
            f"{op}: cache block size {k_cache.shape[1]} != metadata block_size {meta.block_size}"
        )
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: q must be float16, bfloat16 or float32, got {q.dtype}")
    cache_dtype = torch.int8 if k_scale is not None else q.dtype
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if name != "q" and t.dtype != cache_dtype:
            raise ValueError(
                f"{op}: {name} dtype {t.dtype} differs from q dtype {q.dtype}"
                if k_scale is None
                else f"{op}: {name} must be int8 with k_scale/v_scale, got {t.dtype}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous last dimension")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if k_scale is not None:
        if v_cache.shape[3] != k_cache.shape[3]:
            raise ValueError(f"{op}: an int8 cache stores values as wide as keys (no MLA)")
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None or t.dtype != torch.float32 or t.shape != k_cache.shape[:3]:
                raise ValueError(
                    f"{op}: {name} must be float32 {tuple(k_cache.shape[:3])}, got "
                    f"{None if t is None else (t.dtype, tuple(t.shape))}"
                )
            if t.stride(-1) != 1 or t.device != q.device:
                raise ValueError(f"{op}: {name} must be on {q.device} with contiguous heads")
    if sinks is not None and (
        sinks.dtype != torch.float32
        or sinks.shape != (num_heads,)
        or sinks.stride(0) != 1
        or sinks.device != q.device
    ):
        raise ValueError(
            f"{op}: sinks must be float32 [{num_heads}] with unit stride on {q.device}, got "
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )
    num_seqs = meta.q_lens.shape[0]
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{op}: block_tables must be [{num_seqs}, max_num_blocks], got "
            f"{tuple(meta.block_tables.shape)}"
        )
    if meta.block_tables.stride(1) != 1:
        raise ValueError(f"{op}: block_tables must have a contiguous last dimension")
    for name in ("block_tables", "q_start_loc", "q_lens", "kv_lens"):
        t = getattr(meta, name)
        if t.dtype != torch.int32:
            raise ValueError(f"{op}: meta.{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(
                f"{op}: meta.{name} is on {t.device} but q is on {q.device}; build the "
                "metadata for the device of q"
            )
        if name != "block_tables" and (t.shape != (num_seqs,) or not t.is_contiguous()):
            raise ValueError(f"{op}: meta.{name} must be a contiguous [{num_seqs}] tensor")


def _block_sizes(max_q_len: int, group_size: int, head_dim_padded: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N): rows cover whole GQA groups; tl.dot needs every dim >= 16.
    Wide heads (MLA's 512 + 64) take narrower key tiles."""
    rows = max_q_len * group_size
    block_m = max(16, triton.next_power_of_2(group_size), min(64, triton.next_power_of_2(rows)))
    block_n = 64 if head_dim_padded <= 128 else 32 if head_dim_padded <= 256 else 16
    return block_m, block_m // group_size, block_n


def paged_attention_triton(
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
    """q: [num_tokens, num_heads, head_dim]; k_cache: [num_blocks, block_size, num_kv_heads,
    head_dim], v_cache: [num_blocks, block_size, num_kv_heads, v_head_dim] (v_head_dim <=
    head_dim; its own cache or a view into k_cache, MLA), already holding this step's keys
    (int8 with k_scale, v_scale: [num_blocks, block_size, num_kv_heads] float32).
    `sliding_window`, `softcap` and `sinks` ([num_heads] float32) as in
    lmengine.kernels.paged_attention (None = off).
    Returns a new [num_tokens, num_heads, v_head_dim] tensor."""
    _check(q, k_cache, v_cache, meta, k_scale, v_scale, sinks)
    quant = k_scale is not None
    num_tokens, num_heads, head_dim = q.shape
    v_head_dim = v_cache.shape[3]
    out = torch.empty(num_tokens, num_heads, v_head_dim, dtype=q.dtype, device=q.device)
    num_seqs = meta.q_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or meta.max_q_len == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    head_dim_padded = max(16, triton.next_power_of_2(v_head_dim))
    extra = head_dim - v_head_dim
    head_dim_extra = max(16, triton.next_power_of_2(extra)) if extra else 0
    block_m, block_q, block_n = _block_sizes(
        meta.max_q_len, group_size, head_dim_padded + head_dim_extra
    )
    grid = (num_seqs, triton.cdiv(meta.max_q_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.q_start_loc,
        meta.q_lens,
        meta.kv_lens,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        k_scale if quant else k_cache,  # NOTE: unused pointers when not QUANT
        v_scale if quant else v_cache,
        k_scale.stride(0) if quant else 0,
        k_scale.stride(1) if quant else 0,
        v_scale.stride(0) if quant else 0,
        v_scale.stride(1) if quant else 0,
        q if sinks is None else sinks,  # NOTE: an unused pointer without sinks
        head_dim,
        v_head_dim,
        PAGE_SIZE=meta.block_size,
        GROUP_SIZE=group_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim_padded,
        HEAD_DIM_EXTRA=head_dim_extra,
        IEEE_DOT=q.dtype == torch.float32,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        QUANT=quant,
        HAS_SINKS=sinks is not None,
        num_warps=4 if head_dim_padded + head_dim_extra <= 256 else 8,
    )
    return out
