"""What every patched attention shares: head views, q/k norms, (partial) rotary, the KV cache
write and the paged attention call, with the layer's sliding window and logit soft-cap.

A patched attention class mixes `PagedAttentionMixin` in, projects q, k, v its own way (fused,
separate, biased) and calls `self.paged_attend(q, k, v)`. It reads `self.layer_idx`,
`self.head_dim`, `self.scaling` (set by transformers' attention `__init__`), and optionally
`self.sliding_window` and `self.attn_logit_softcapping` (None = off).
"""

from __future__ import annotations

import torch

from lmengine.kernels import apply_rotary, fill_kv_cache, paged_attention, rotary_fill_kv_cpu
from lmengine.models.context import get_step_context


def apply_partial_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on the first cos.shape[-1] dims of each head, the rest passes (GPT-NeoX, Phi).
    q: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, rotary_dim]."""
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return apply_rotary(q, k, cos, sin)
    q_rot, k_rot = apply_rotary(q[..., :rot], k[..., :rot], cos, sin)
    return torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1)


def set_rotary(rotary_emb: torch.nn.Module, hidden_states: torch.Tensor) -> None:
    """Compute this step's cos/sin once per forward (every layer reads them from the context)."""
    ctx = get_step_context()
    cos, sin = rotary_emb(hidden_states, ctx.positions[None])  # [1, num_tokens, rotary_dim]
    ctx.cos, ctx.sin = cos[0], sin[0]


class PagedAttentionMixin:
    """Attention over the paged KV cache for any HF attention module. Holds no weights."""

    sliding_window: int | None = None  # keys a query sees (None: all before it)
    attn_logit_softcapping: float | None = None  # Gemma 2's c in c * tanh(scores / c)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head norms before rotary (Qwen3 overrides); identity here."""
        return q, k

    def paged_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """q: [num_tokens, heads * head_dim], k, v: [num_tokens, kv_heads * head_dim] (or
        already split into heads) -> [num_tokens, heads * head_dim]. Rotary applies when the
        model put cos/sin into the step context."""
        ctx = get_step_context()
        num_tokens = q.shape[0]
        # (k, v), or (k, v, k_scale, v_scale) with an int8 cache
        k_cache, v_cache, *scales = ctx.kv_caches[self.layer_idx]
        fused = None
        if ctx.cos is not None and not scales and type(self).norm_qk is _no_qk_norm:
            # [num_tokens, heads, head_dim], k and v in the cache; None: not applicable here
            fused = rotary_fill_kv_cpu(
                q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, ctx.slot_mapping
            )
        if fused is not None:
            q = fused
        else:
            # [num_tokens, heads, head_dim] and [num_tokens, kv_heads, head_dim]
            q = q.view(num_tokens, -1, self.head_dim)
            k = k.view(num_tokens, -1, self.head_dim)
            v = v.view(num_tokens, -1, self.head_dim)
            q, k = self.norm_qk(q, k)
            if ctx.cos is not None:
                q, k = apply_partial_rotary(q, k, ctx.cos, ctx.sin)
            fill_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping, *scales)
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            ctx.attn_meta,
            self.scaling if scale is None else scale,
            self.sliding_window,
            self.attn_logit_softcapping,
            *scales,
        )
        return out.view(num_tokens, -1)


_no_qk_norm = PagedAttentionMixin.norm_qk  # the fused rotary path needs q, k as they come
