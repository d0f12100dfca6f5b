"""Triton multi-LoRA over paged adapter weights, SGMV style (Punica, S-LoRA): two kernels.

- shrink: one program per (segment, block of BLOCK_M tokens) computes
  h = scale * x[tokens] @ A[pages]^T, [BLOCK_M, BLOCK_R], accumulating over the input in
  BLOCK_K chunks; the pages are the segment's adapter's row of `page_table`.
- expand: one program per (segment, token block, BLOCK_N output columns) adds h @ B[pages]
  into out[tokens]. Every token belongs to one segment, so no two programs write one row.

h lives in a float32 scratch of [num_lora_tokens, BLOCK_R], indexed by sorted position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmengine.kernels.lora_meta import LoRAMeta

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in]
    a_ptr,  # [num_pages, in]
    scale_ptr,  # [num_pages]
    page_table_ptr,  # [num_adapters, max_rank]
    sorted_tokens_ptr,  # [num_lora_tokens]
    seg_starts_ptr,  # [num_segments + 1]
    seg_adapter_ptr,  # [num_segments]
    h_ptr,  # [num_lora_tokens, BLOCK_R] float32
    in_features,
    max_rank,
    stride_x_tok,
    stride_a_page,
    stride_pt_adapter,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    block = tl.program_id(1)
    seg_start = tl.load(seg_starts_ptr + seg)
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if block * BLOCK_M < seg_end - seg_start:
        offs_m = seg_start + block * BLOCK_M + tl.arange(0, BLOCK_M)  # sorted positions
        mask_m = offs_m < seg_end
        tokens = tl.load(sorted_tokens_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        adapter = tl.load(seg_adapter_ptr + seg).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < max_rank
        pages = tl.load(
            page_table_ptr + adapter * stride_pt_adapter + offs_r, mask=mask_r, other=0
        ).to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < in_features
            xs = tl.load(
                x_ptr + tokens[:, None] * stride_x_tok + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            a = tl.load(
                a_ptr + pages[None, :] * stride_a_page + offs_k[:, None],
                mask=mask_r[None, :] & mask_k[:, None],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_K, BLOCK_R]
            acc += tl.dot(xs, a, input_precision="ieee")
        scale = tl.load(scale_ptr + pages, mask=mask_r, other=0.0).to(tl.float32)  # [BLOCK_R]
        acc = acc * scale[None, :]
        tl.store(h_ptr + offs_m[:, None] * BLOCK_R + offs_r[None, :], acc, mask=mask_m[:, None])


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [num_lora_tokens, BLOCK_R] float32
    b_ptr,  # [num_pages, out]
    out_ptr,  # [num_tokens, out]
    page_table_ptr,
    sorted_tokens_ptr,
    seg_starts_ptr,
    seg_adapter_ptr,
    out_features,
    max_rank,
    stride_b_page,
    stride_out_tok,
    stride_pt_adapter,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(0)
    block = tl.program_id(1)
    col_block = tl.program_id(2)
    seg_start = tl.load(seg_starts_ptr + seg)
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if block * BLOCK_M < seg_end - seg_start:
        offs_m = seg_start + block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seg_end
        tokens = tl.load(sorted_tokens_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        adapter = tl.load(seg_adapter_ptr + seg).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < max_rank
        pages = tl.load(
            page_table_ptr + adapter * stride_pt_adapter + offs_r, mask=mask_r, other=0
        ).to(tl.int64)
        h = tl.load(
            h_ptr + offs_m[:, None] * BLOCK_R + offs_r[None, :], mask=mask_m[:, None], other=0.0
        )  # [BLOCK_M, BLOCK_R]
        offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < out_features
        b = tl.load(
            b_ptr + pages[:, None] * stride_b_page + offs_n[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        y = tl.dot(h, b, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        out_ptrs = out_ptr + tokens[:, None] * stride_out_tok + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        o = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (o + y).to(out_ptr.dtype.element_ty), mask=mask)


def lora_add_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_scale: torch.Tensor,
    page_table: torch.Tensor,
    meta: LoRAMeta,
    block_m: int = 16,
) -> torch.Tensor:
    """out [T, out] += per-token LoRA of x [T, in], in place; see `lora_add_ref`."""
    op = "lora_add_triton"
    for name, t in (("out", out), ("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{op}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous last dimension")
    tensors = (x, lora_a, lora_b, lora_scale, page_table, meta.sorted_tokens)
    if any(t.device != out.device for t in tensors):
        raise ValueError(f"{op}: every tensor must be on {out.device}")
    num_segments = meta.num_segments
    if num_segments == 0 or meta.max_seg_len == 0:
        return out
    page_table = page_table.contiguous()
    max_rank = page_table.shape[1]
    block_r = max(16, triton.next_power_of_2(max_rank))
    num_lora_tokens = meta.sorted_tokens.shape[0]
    h = torch.empty(num_lora_tokens, block_r, dtype=torch.float32, device=out.device)
    num_m = triton.cdiv(meta.max_seg_len, block_m)
    in_features, out_features = x.shape[1], out.shape[1]
    block_k = min(64, max(16, triton.next_power_of_2(in_features)))
    block_n = min(64, max(16, triton.next_power_of_2(out_features)))
    _lora_shrink_kernel[(num_segments, num_m)](
        x,
        lora_a,
        lora_scale,
        page_table,
        meta.sorted_tokens,
        meta.seg_starts,
        meta.seg_adapter,
        h,
        in_features,
        max_rank,
        x.stride(0),
        lora_a.stride(0),
        page_table.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    _lora_expand_kernel[(num_segments, num_m, triton.cdiv(out_features, block_n))](
        h,
        lora_b,
        out,
        page_table,
        meta.sorted_tokens,
        meta.seg_starts,
        meta.seg_adapter,
        out_features,
        max_rank,
        lora_b.stride(0),
        out.stride(0),
        page_table.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )
    return out
