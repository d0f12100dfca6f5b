"""How one step's packed tokens group by LoRA adapter: segments of one adapter each (the Triton
kernels run one program per segment and token block) and equal tiles of them (the CPU path).

Shared by the reference and CPU paths (`lmengine.kernels.lora`) and the Triton launcher
(`lmengine.kernels.triton.lora`); it imports neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
