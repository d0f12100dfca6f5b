"""What every patched attention shares: head views, q/k norms, (partial) rotary, the KV cache
write and the paged attention call, with the layer's sliding window and logit soft-cap.

A patched attention class mixes `PagedAttentionMixin` in, projects q, k, v its own way (fused,
separate, biased) and calls `self.paged_attend(q, k, v)`. It reads `self.layer_idx`,
`self.head_dim`, `self.scaling` (set by transformers' attention `__init__`), and optionally
`self.sliding_window` and `self.attn_logit_softcapping` (None = off). A layer whose position
encoding differs from the model's (no rope at all, another base) overrides `rotary`; one whose
rotation pairs differ overrides `rotate`; one with learned sinks (gpt-oss), `attention_sinks`.
"""

from __future__ import annotations

import torch

from lmengine.kernels import apply_rotary, fill_kv_cache, paged_attention, rotary_fill_kv_cpu
from lmengine.models.context import KeptRows, get_step_context


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


def set_rotary(rotary_emb: torch.nn.Module, hidden_states: torch.Tensor, *args) -> None:
    """Compute this step's cos/sin once per forward (every layer reads them from the context).
    `args`: what else the HF rotary module takes (Gemma 3: the layer type)."""
    ctx = get_step_context()
    cos, sin = rotary_emb(hidden_states, ctx.positions[None], *args)  # [1, tokens, rotary_dim]
    ctx.cos, ctx.sin = cos[0], sin[0]


class PagedAttentionMixin:
    """Attention over the paged KV cache for any HF attention module. Holds no weights."""

    sliding_window: int | None = None  # keys a query sees (None: all before it)
    attn_logit_softcapping: float | None = None  # Gemma 2's c in c * tanh(scores / c)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head norms before rotary (Qwen3 overrides); identity here."""
        return q, k

    def rotary(self, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's (cos, sin) [num_tokens, rotary_dim], or None for no rotary: the
        model's, from the step context (SmolLM3's no-rope layers and Gemma 3's local layers
        override)."""
        return None if ctx.cos is None else (ctx.cos, ctx.sin)

    def attention_sinks(self) -> torch.Tensor | None:
        """A learned logit per head with no value, one more term in each softmax's
        denominator (gpt-oss overrides); None here.

        NOTE: a method, not a class attribute: an attribute named like the HF module's
        `sinks` parameter would hide it."""
        return None

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary on q, k [num_tokens, heads, head_dim]: halves rotated together (Llama,
        NeoX), on the first cos.shape[-1] dims (GLM-4 overrides: adjacent pairs). In cos's
        dtype when it is wider (OLMo 2 keeps float32 cos/sin under bfloat16 weights), rounded
        back to q's afterwards, as transformers does."""
        if cos.dtype == q.dtype:
            return apply_partial_rotary(q, k, cos, sin)
        q_rot, k_rot = apply_partial_rotary(q.to(cos.dtype), k.to(cos.dtype), cos, sin)
        return q_rot.to(q.dtype), k_rot.to(k.dtype)

    def paged_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        kept: KeptRows | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, heads * head_dim], k, v: [num_tokens, kv_heads * head_dim] (or
        already split into heads) -> [num_tokens, heads * head_dim]. Rotary applies when the
        model put cos/sin into the step context. With `kept`, every token's K and V go to the
        cache and only the kept rows attend: [num_kept, heads * head_dim]."""
        ctx = get_step_context()
        num_tokens = q.shape[0]
        # (k, v), or (k, v, k_scale, v_scale) with an int8 cache
        k_cache, v_cache, *scales = ctx.kv_caches[self.layer_idx]
        rotary = self.rotary(ctx)
        fused = None
        if rotary is not None and not scales and _plain(type(self)):
            # [num_tokens, heads, head_dim], k and v in the cache; None: not applicable here
            fused = rotary_fill_kv_cpu(q, k, v, *rotary, k_cache, v_cache, ctx.slot_mapping)
        if fused is not None:
            q = fused
        else:
            # [num_tokens, heads, head_dim] and [num_tokens, kv_heads, head_dim]
            q = q.view(num_tokens, -1, self.head_dim)
            k = k.view(num_tokens, -1, self.head_dim)
            v = v.view(num_tokens, -1, self.head_dim)
            q, k = self.norm_qk(q, k)
            if rotary is not None:
                q, k = self.rotate(q, k, *rotary)
            fill_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping, *scales)
        meta = ctx.attn_meta
        if kept is not None:
            if kept.meta is None:  # no query is read: writing K and V was all
                return q.new_empty(0, q.shape[1] * v_cache.shape[-1])
            q, meta, num_tokens = q[kept.rows], kept.meta, kept.rows.numel()
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            self.scaling if scale is None else scale,
            self.sliding_window,
            self.attn_logit_softcapping,
            *scales,
            sinks=self.attention_sinks(),
        )
        return out.view(num_tokens, -1)


class PerHeadQKNorm:
    """q/k norms per head before rotary (Qwen3, Qwen3-MoE, Gemma 3): the HF modules `q_norm`
    and `k_norm` over head_dim. Mixed in before the patched attention class."""

    q_norm: torch.nn.Module
    k_norm: torch.nn.Module

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim]. q and k are column slices of the fused
        projection; contiguous copies let the Triton norm view them as rows."""
        return self.q_norm(q.contiguous()), self.k_norm(k.contiguous())


def _plain(cls: type) -> bool:
    """Whether `cls` takes q and k as they come and rotates their halves: what the fused
    rotary + cache write path does."""
    return cls.norm_qk is PagedAttentionMixin.norm_qk and cls.rotate is PagedAttentionMixin.rotate
