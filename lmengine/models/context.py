"""The per-step context: what patched modules read instead of HF forward arguments.

The ModelRunner builds one StepContext per step and installs it around the forward; patched
modules call `get_step_context()`. Scheduler objects never travel through it: only tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lmengine.kernels import AttentionMetadata


@dataclass
class StepContext:
    positions: torch.Tensor  # [num_tokens] int64, position of each packed token
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot each token's KV goes to
    attn_meta: AttentionMetadata  # per-sequence lengths, block tables, CPU gather plans
    # per layer (k, v) [blocks, bs, kv_heads, d]; int8 KV: (k, v, k_scale, v_scale)
    kv_caches: list[tuple[torch.Tensor, ...]]
    logits_indices: torch.Tensor  # [num_samples] packed rows whose logits are needed
    cos: torch.Tensor | None = None  # [num_tokens, head_dim], set by the patched model
    sin: torch.Tensor | None = None
    # per layer type, where layers rotate differently (Gemma 3's local and global bases)
    rotary_by_type: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    lora: Any = None  # lmengine.models.lora.LoRAStep when a scheduled sequence uses an adapter
    hooks: Any = None  # lmengine.models.hooks.LayerHooks when a request steers or reads layers
    # the backbone ran its last layer on the logits rows alone (`kept_rows`): its output is
    # those rows, in logits_indices' order
    logits_rows_only: bool = False
    _kept: Any = None  # kept_rows's, built once


@dataclass
class KeptRows:
    """The rows of a step whose last layer's output is read (its logits rows), each as a
    one-token decode over the cache at its own position: a model may run its last layer's
    attention queries, output projection and MLP on these rows alone, once every row's K and
    V are in the cache, for the same result on them. No row at all (a prompt chunk short of
    its end): the last layer writes its K and V and stops there."""

    rows: torch.Tensor  # [num_kept] packed rows (logits_indices)
    # one sequence per row: its blocks, kv_len = position + 1; None: no row is kept
    meta: AttentionMetadata | None


def kept_rows(ctx: StepContext) -> KeptRows | None:
    """The step's KeptRows, or None when every row is read (a step of decodes alone) or the
    step is not on the CPU. A step that reads no row (prompt chunks short of their ends) keeps
    none: KeptRows with no rows and no metadata."""
    if ctx._kept is None:
        rows = ctx.logits_indices
        meta = ctx.attn_meta
        if rows.numel() >= ctx.positions.numel() or rows.is_cuda or not meta.groups:
            ctx._kept = False
        elif rows.numel() == 0:
            ctx._kept = KeptRows(rows, None)
        else:
            seqs = torch.searchsorted(meta.q_start_loc, rows.int(), right=True) - 1
            kv_lens = (ctx.positions[rows] + 1).tolist()
            bs = meta.block_size
            tables = [t[: -(-n // bs)] for t, n in zip(meta.block_tables[seqs].tolist(), kv_lens)]
            kept = AttentionMetadata.build(tables, [1] * len(kv_lens), kv_lens, bs)
            ctx._kept = KeptRows(rows, kept)
    return ctx._kept or None


_CURRENT: StepContext | None = None


def get_step_context() -> StepContext:
    if _CURRENT is None:
        raise RuntimeError("a patched module ran outside a step: no StepContext is installed")
    return _CURRENT


@contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    global _CURRENT
    previous, _CURRENT = _CURRENT, ctx
    try:
        yield ctx
    finally:
        _CURRENT = previous


def build_step_context(
    q_lens: list[int],
    start_pos: list[int],
    block_tables: list[list[int]],
    needs_sample: list[bool],
    block_size: int,
    kv_caches: list[tuple[torch.Tensor, ...]],
    device: torch.device,
    kv_token_bytes: int = 0,
    num_logits: list[int] | None = None,
    num_leading_logits: list[int] | None = None,
    leading_offsets: list[int] | None = None,
) -> StepContext:
    """The context of one packed step: sequence b computes `q_lens[b]` tokens from position
    `start_pos[b]` on, in the blocks of `block_tables[b]`; rows with `needs_sample` get logits
    of their last token, or of their last `num_logits[b]` tokens when given (speculative
    decoding verifies every drafted token), after the logits of `num_leading_logits[b]` tokens
    from its token `leading_offsets[b]` on when given (prompt scoring). Shared by the
    ModelAgent and every tensor-parallel rank, so they pack identically."""
    kv_lens = [s + n for s, n in zip(start_pos, q_lens)]
    meta = AttentionMetadata.build(
        block_tables, q_lens, kv_lens, block_size, device, kv_token_bytes=kv_token_bytes
    )
    if max(q_lens) == 1 and num_logits is None and num_leading_logits is None:
        # NOTE: a step of decodes alone (every step of a busy server but the ones a prompt
        # joins) in plain lists and three tensors: the general path's small torch ops cost ~1
        # ms more of a 64-row step, each slow with the caches cold after the forward
        slots = [
            t[p // block_size] * block_size + p % block_size
            for t, p in zip(block_tables, start_pos)
        ]
        rows = [b for b, sample in enumerate(needs_sample) if sample]
        return StepContext(
            positions=torch.tensor(start_pos).to(device),
            slot_mapping=torch.tensor(slots).to(device),
            attn_meta=meta,
            kv_caches=kv_caches,
            logits_indices=torch.tensor(rows, dtype=torch.long).to(device),
        )
    q_lens_t = torch.tensor(q_lens)
    # position of every packed token: start of its sequence + offset within the chunk
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)  # [T]
    first_token = torch.cumsum(q_lens_t, 0) - q_lens_t  # [B]
    offset = torch.arange(int(q_lens_t.sum())) - first_token[seq_of_token]
    positions = torch.tensor(start_pos)[seq_of_token] + offset  # [T]
    # flat cache slot of every packed token
    slot_mapping = (
        meta.block_tables.cpu()[seq_of_token, positions // block_size].long() * block_size
        + positions % block_size
    )
    if num_logits is None and num_leading_logits is None:
        sample_rows = torch.tensor(needs_sample, dtype=torch.bool)
        logits_indices = (first_token + q_lens_t - 1)[sample_rows]  # [num_samples]
    else:  # per sequence its num_leading_logits[b] scoring rows, then its last num_logits[b]
        trailing = torch.tensor(num_logits if num_logits is not None else needs_sample).long()
        leading = torch.tensor(num_leading_logits or [0] * len(q_lens)).long()
        lead_from = torch.tensor(leading_offsets or [0] * len(q_lens)).long()
        counts = leading + trailing  # [B]
        seq_of_row = torch.repeat_interleave(torch.arange(len(q_lens)), counts)
        rank = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[seq_of_row]
        offset = torch.where(
            rank < leading[seq_of_row],
            lead_from[seq_of_row] + rank,
            q_lens_t[seq_of_row] - counts[seq_of_row] + rank,
        )
        logits_indices = first_token[seq_of_row] + offset  # [num_logits]
    return StepContext(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        attn_meta=meta,
        kv_caches=kv_caches,
        logits_indices=logits_indices.to(device),
    )
