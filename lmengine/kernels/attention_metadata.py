"""Per-step attention metadata: the packed batch's lengths and block tables, built once per step
and read by every attention layer, plus the gather plans of the CPU path.

Shared by the reference and CPU paths (`lmengine.kernels.paged_attention`) and the Triton
launcher (`lmengine.kernels.triton.paged_attention`); it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmengine.kernels import cpu_ext


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
    # prompt chunks (max_q > 1), for the compiled prefill kernel reading the cache in place:
    # (block tables [n, max_blocks], q_start, q_lens, kv_lens [n]), int32
    prefill_args: tuple[torch.Tensor, ...] | None = None

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
        # one tensor from padded lists (one torch.tensor per row cost ~7 us each)
        table = torch.tensor(
            [[*t, *([0] * (width - len(t)))] for t in block_tables], dtype=torch.int32
        )  # [num_seqs, width], also at width 0
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
                budget = 0 if sel is is_decode and _has_decode_kernel() else kv_token_bytes
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
    prefill_args = None
    if max_q == 1:
        decode_tables = meta.block_tables[seqs, :max_blocks].contiguous()
        decode_kv_lens = meta.kv_lens[seqs].contiguous()
    else:
        prefill_args = (
            meta.block_tables[seqs, :max_blocks].contiguous(),
            meta.q_start_loc[seqs].contiguous(),
            meta.q_lens[seqs].contiguous(),
            meta.kv_lens[seqs].contiguous(),
        )
    return _GroupPlan(
        prefill_args=prefill_args,
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


def _has_decode_kernel() -> bool:
    """Whether the compiled gather-free decode kernel is built (then decodes gather nothing)."""
    return cpu_ext.load() is not None
