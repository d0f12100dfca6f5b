"""Multi-LoRA on a packed batch: `out += scale * B(A(x))` per token, each token with its own
adapter (or none), over weights stored in pages of a shared pool (S-LoRA, Punica SGMV).

Pool layout, for one linear of one layer: page p is one rank-row of an adapter,
`lora_a[p]` ([in]) a row of A, `lora_b[p]` ([out]) a row of B^T and `lora_scale[p]` its
scale. An adapter of rank r owns r pages anywhere in the pool; `page_table[i]` lists the
pages of the step's i-th adapter, padded with a page whose scale is 0 (its A and B are
zero), so adapters of different ranks share one table without a rank array.

Tokens are grouped once per step (`LoRAMeta.build`) into segments of one adapter each:
sorted token indices, segment starts and the adapter row of each segment. The CPU path cuts
the segments into equal tiles and runs two batched matmuls per linear (no Python loop over
tokens or adapters), or the compiled kernel (csrc/lora_ops.cpp) reads each segment's pages
in place when it is built; the Triton path (`lmengine.kernels.triton.lora`) runs one program per
(segment, token block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmengine.kernels import cpu_ext


@dataclass
class LoRAMeta:
    """How one step's packed tokens group by adapter; built once, read by every LoRA linear."""

    token_adapter: torch.Tensor  # [num_tokens] int64, row of page_table, -1 = no adapter
    sorted_tokens: torch.Tensor  # [num_lora_tokens] int64, token indices grouped by adapter
    seg_starts: torch.Tensor  # [num_segments + 1] int64, offsets into sorted_tokens
    seg_adapter: torch.Tensor  # [num_segments] int64, row of page_table of each segment
    max_seg_len: int
    tile_tokens: torch.Tensor  # [num_tiles, tile_size] int64, token of each tile slot (pad: 0)
    tile_adapter: torch.Tensor  # [num_tiles] int64, row of page_table of each tile
    tile_valid: torch.Tensor  # [num_tiles, tile_size, 1] float32, 0 on padding slots
    tile_slots: torch.Tensor  # [num_lora_tokens] int64, flat tile slot of sorted_tokens[i]

    @property
    def num_segments(self) -> int:
        return self.seg_adapter.shape[0]

    @classmethod
    def build(cls, token_adapter: torch.Tensor) -> LoRAMeta:
        """token_adapter: [num_tokens] int64 on the CPU (moved to its device by `.to`)."""
        token_adapter = token_adapter.long()
        valid = token_adapter >= 0
        order = torch.argsort(token_adapter, stable=True)
        sorted_tokens = order[valid[order]]  # [N], grouped by adapter, in token order
        ids, counts = torch.unique_consecutive(token_adapter[sorted_tokens], return_counts=True)
        seg_starts = torch.zeros(ids.numel() + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=seg_starts[1:])
        max_seg_len = int(counts.max()) if counts.numel() else 0
        # tiles: each segment cut into pieces of tile_size tokens; padding is bounded by one
        # tile per segment (long prefills) or by the largest segment (decode steps)
        num_lora_tokens, num_segments = sorted_tokens.numel(), ids.numel()
        tile_size = max_seg_len
        if num_segments and num_segments * max_seg_len > 2 * num_lora_tokens:
            tile_size = max(1, math.ceil(num_lora_tokens / num_segments))
        if num_lora_tokens:
            tiles_per_seg = (counts + tile_size - 1) // tile_size  # [S]
            first_tile = torch.cumsum(tiles_per_seg, 0) - tiles_per_seg
            seg_of = torch.repeat_interleave(torch.arange(num_segments), counts)  # [N]
            rank_in_seg = torch.arange(num_lora_tokens) - seg_starts[seg_of]
            tile = first_tile[seg_of] + rank_in_seg // tile_size
            slot = rank_in_seg % tile_size
            num_tiles = int(tiles_per_seg.sum())
            tile_tokens = torch.zeros(num_tiles, tile_size, dtype=torch.long)
            tile_valid = torch.zeros(num_tiles, tile_size, 1)
            tile_tokens[tile, slot] = sorted_tokens
            tile_valid[tile, slot] = 1.0
            tile_adapter = torch.repeat_interleave(ids, tiles_per_seg)
            tile_slots = tile * tile_size + slot
        else:
            tile_tokens = torch.zeros(0, 0, dtype=torch.long)
            tile_valid = torch.zeros(0, 0, 1)
            tile_adapter = torch.zeros(0, dtype=torch.long)
            tile_slots = torch.zeros(0, dtype=torch.long)
        return cls(
            token_adapter,
            sorted_tokens,
            seg_starts,
            ids,
            max_seg_len,
            tile_tokens,
            tile_adapter,
            tile_valid,
            tile_slots,
        )

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> LoRAMeta:
        return LoRAMeta(
            self.token_adapter.to(device),
            self.sorted_tokens.to(device),
            self.seg_starts.to(device),
            self.seg_adapter.to(device),
            self.max_seg_len,
            self.tile_tokens.to(device),
            self.tile_adapter.to(device),
            self.tile_valid.to(device, dtype),
            self.tile_slots.to(device),
        )


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
