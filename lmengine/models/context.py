"""The per-step context: what patched modules read instead of HF forward arguments.

The ModelAgent builds one StepContext per step and installs it around the forward; patched
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
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [blocks, bs, kv_heads, d]
    logits_indices: torch.Tensor  # [num_samples] packed rows whose logits are needed
    cos: torch.Tensor | None = None  # [num_tokens, head_dim], set by the patched model
    sin: torch.Tensor | None = None
    lora: Any = None  # lmengine.models.lora.LoRAStep when a scheduled sequence uses an adapter


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
