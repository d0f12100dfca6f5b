"""Multi-LoRA on a packed batch: `out += scale * B(A(x))` per token, each token with its own
adapter (or none), over weights stored in pages of a shared pool (S-LoRA, Punica SGMV).

Pool layout, for one linear of one layer: page p is one rank-row of an adapter,
`lora_a[p]` ([in]) a row of A, `lora_b[p]` ([out]) a row of B^T and `lora_scale[p]` its
scale. An adapter of rank r owns r pages anywhere in the pool; `page_table[i]` lists the
pages of the step's i-th adapter, padded with a page whose scale is 0 (its A and B are
zero), so adapters of different ranks share one table without a rank array.

Tokens are grouped once per step (`LoRAMeta.build`, in lmengine.kernels.lora_meta) into
segments of one adapter each: sorted token indices, segment starts and the adapter row of each
segment. The CPU path cuts the segments into equal tiles and runs two batched matmuls per
linear (no Python loop over tokens or adapters), or the compiled kernel (csrc/lora_ops.cpp)
reads each segment's pages in place when it is built; the Triton path
(`lmengine.kernels.triton.lora`) runs one program per (segment, token block).
"""

from __future__ import annotations

import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.lora_meta import LoRAMeta


def _check(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_scale: torch.Tensor,
    page_table: torch.Tensor,
) -> None:
    if x.dim() != 2 or out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"lora: x {tuple(x.shape)} and out {tuple(out.shape)} must be [T, *]")
    num_pages = lora_a.shape[0]
    if lora_a.shape != (num_pages, x.shape[1]) or lora_b.shape != (num_pages, out.shape[1]):
        raise ValueError(
            f"lora: lora_a {tuple(lora_a.shape)} must be [pages, {x.shape[1]}] and lora_b "
            f"{tuple(lora_b.shape)} must be [pages, {out.shape[1]}]"
        )
    if lora_scale.shape != (num_pages,):
        raise ValueError(f"lora: lora_scale {tuple(lora_scale.shape)} must be [{num_pages}]")
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError("lora: page_table must be a 2-D integer tensor [adapters, max_rank]")


def lora_add_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_scale: torch.Tensor,
    page_table: torch.Tensor,
    token_adapter: torch.Tensor,
) -> torch.Tensor:
    """Reference, one token at a time: out[t] += B_a (scale_a * (A_a x[t])) for the adapter
    a = token_adapter[t] (skipped when -1). out: [T, out]; x: [T, in]. Returns out."""
    _check(out, x, lora_a, lora_b, lora_scale, page_table)
    for t in range(x.shape[0]):
        a = int(token_adapter[t])
        if a < 0:
            continue
        pages = page_table[a].long()  # [max_rank]
        h = (lora_a[pages].float() @ x[t].float()) * lora_scale[pages].float()  # [max_rank]
        out[t] += (h @ lora_b[pages].float()).to(out.dtype)
    return out


def lora_add_cpu(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_scale: torch.Tensor,
    page_table: torch.Tensor,
    meta: LoRAMeta,
    lora_cols: torch.Tensor | None = None,
) -> torch.Tensor:
    """The compiled kernel (pages read in place) when it is built and the tensors are
    float32; else tiles of one adapter each, padded to one size, two batched matmuls.
    `lora_cols` [pages, 2]: the [begin, end) columns where each page's B row can be non-zero
    (a hint: only the compiled kernel uses it to skip work; None means all columns)."""
    ext = cpu_ext.load()
    if ext is not None and all(
        t.dtype == torch.float32 and t.is_contiguous() for t in (out, x, lora_a, lora_b)
    ):
        ext.lora_sgmv(
            out, x, lora_a, lora_b, lora_scale, lora_cols, page_table,
            meta.sorted_tokens, meta.seg_starts, meta.seg_adapter,
        )  # fmt: skip
        return out
    return lora_add_tiles(out, x, lora_a, lora_b, lora_scale, page_table, meta)


def lora_add_tiles(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_scale: torch.Tensor,
    page_table: torch.Tensor,
    meta: LoRAMeta,
) -> torch.Tensor:
    """The PyTorch CPU path: tiles of one adapter each, padded to one size, two batched
    matmuls per call (no Python loop over tokens or adapters)."""
    if meta.tile_tokens.numel() == 0:
        return out
    num_tiles, tile_size = meta.tile_tokens.shape
    # NOTE: index_select copies whole rows; advanced indexing (`lora_a[pages]`) was 3x slower
    pages = page_table.long().index_select(0, meta.tile_adapter).view(-1)  # [tiles * max_rank]
    max_rank = page_table.shape[1]
    a = lora_a.index_select(0, pages).view(num_tiles, max_rank, -1)  # [tiles, max_rank, in]
    b = lora_b.index_select(0, pages).view(num_tiles, max_rank, -1)  # [tiles, max_rank, out]
    scale = lora_scale.index_select(0, pages).view(num_tiles, 1, max_rank)
    xs = x.index_select(0, meta.tile_tokens.view(-1)).view(num_tiles, tile_size, -1)
    h = torch.bmm(xs, a.transpose(1, 2)) * (scale * meta.tile_valid)  # [tiles, tile, rank]
    y = torch.bmm(h, b).view(num_tiles * tile_size, -1)  # [tiles * tile_size, out]
    # NOTE: each LoRA token has one slot, so a gather-add-copy does what index_add_ does;
    # index_add_ (scatter_add_ inside) took ~100x longer on CPU for a 16-row decode
    tokens = meta.sorted_tokens
    summed = out.index_select(0, tokens) + y.index_select(0, meta.tile_slots)  # [N, out]
    out.index_copy_(0, tokens, summed)
    return out


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_scale: torch.Tensor,
    page_table: torch.Tensor,
    meta: LoRAMeta,
    lora_cols: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, out] += per-token LoRA of x [T, in] (in place); returns out. `lora_cols`: see
    `lora_add_cpu`."""
    _check(out, x, lora_a, lora_b, lora_scale, page_table)
    if out.is_cuda:
        from lmengine.kernels.triton.lora import lora_add_triton

        return lora_add_triton(out, x, lora_a, lora_b, lora_scale, page_table, meta)
    return lora_add_cpu(out, x, lora_a, lora_b, lora_scale, page_table, meta, lora_cols)
