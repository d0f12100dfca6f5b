"""DeepSeek-V3 / R1: multi-head latent attention (MLA) over a paged latent cache, and a mixture
of experts with shared experts and grouped, bias-corrected routing after dense first layers.

MLA in its absorbed form (as vLLM and SGLang run it). Keys and values are never expanded per
head: each token caches its normed latent c (kv_lora_rank wide) and its rotated rope key
k_rot (qk_rope_head_dim wide), one "head" of [c | k_rot]. `kv_b_proj` maps c to every head's
no-rope key and value, W_UK_h and W_UV_h, so

    score_h(t, s) = q_nope_h(t) . W_UK_h c(s) + q_rot_h(t) . k_rot(s)
                  = [q_nope_h(t) W_UK_h | q_rot_h(t)] . [c(s) | k_rot(s)]
    out_h(t)      = W_UV_h sum_s p_h(t, s) c(s)

which is multi-query attention with one KV head: query [q_nope W_UK | q_rot], key the cached
row, value its first kv_lora_rank dims (the cache's v is a view of k: engine/cache_engine.py).
The per-head up-projections run on the queries before and the latent outputs after.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3MLP,
    DeepseekV3Model,
    DeepseekV3MoE,
    DeepseekV3RMSNorm,
)

from lmengine.kernels import paged_attention
from lmengine.models.attention import apply_partial_rotary
from lmengine.models.context import get_step_context
from lmengine.models.layers import PackedLinear
from lmengine.models.llama import (
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)
from lmengine.models.moe import ExpertsMixin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's `rope_interleave`: the pairs (2i, 2i + 1) of x [num_tokens, heads, d] rotate
    by frequency i, and the result comes out in halves layout (evens' rotations, then odds'),
    as transformers writes it; cos, sin: [num_tokens, d] (each frequency twice)."""
    cos = cos[:, None, : cos.shape[-1] // 2]
    sin = sin[:, None, : sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class PatchedDeepseekV3RMSNorm(PatchedRMSNorm, DeepseekV3RMSNorm):
    pass


class PatchedDeepseekV3MLP(PatchedLlamaMLP, DeepseekV3MLP):
    pass


class PatchedDeepseekV3Attention(DeepseekV3Attention):
    """MLA, absorbed, over the paged latent cache (see the module docstring)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def lmengine_post_patch(self) -> None:
        for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            linear = getattr(self, name)
            if linear is not None:
                PackedLinear.convert(linear)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as W_UK [heads, nope, latent] and W_UV [heads, v, latent] (views;
        made per call: under tensor parallelism the weight is loaded after patching)."""
        nope, v_dim = self.qk_nope_head_dim, self.v_head_dim
        w = self.kv_b_proj.weight.view(-1, nope + v_dim, self.kv_lora_rank)
        return w[:, :nope], w[:, nope:]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ctx = get_step_context()
        cos, sin = ctx.cos, ctx.sin
        assert cos is not None and sin is not None, "the model sets the step's rotary"
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, -1, self.qk_head_dim)  # [num_tokens, heads, nope + rope]
        q_nope, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())  # [num_tokens, latent]
        k_rot = k_rot[:, None]  # [num_tokens, 1, rope]
        if self.config.rope_interleave:
            q_rot = rotate_interleaved(q_rot, cos, sin)
            k_rot = rotate_interleaved(k_rot, cos, sin)
        else:
            q_rot, k_rot = apply_partial_rotary(q_rot, k_rot, cos, sin)
        w_uk, w_uv = self.up_projections()
        # [heads, num_tokens, nope] @ [heads, nope, latent] -> [num_tokens, heads, latent]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_rot), dim=-1)  # [num_tokens, heads, latent + rope]
        key = torch.cat((latent[:, None], k_rot), dim=-1)  # [num_tokens, 1, latent + rope]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, ctx.slot_mapping, key)
        out = paged_attention(query, k_cache, v_cache, ctx.attn_meta, self.scaling)
        # [heads, num_tokens, latent] @ [heads, latent, v] -> [num_tokens, heads * v]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(num_tokens, -1))


class PatchedDeepseekV3MoE(ExpertsMixin, DeepseekV3MoE):
    """Grouped, bias-corrected top-k routing, the routed experts in the batched kernel, plus
    the shared experts (a dense MLP) on every token."""

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' DeepseekV3TopkRouter: sigmoid scores (float32); experts chosen by
        score + correction bias within the best `topk_group` of `n_group` groups (a group
        ranks by its two best); weights the plain scores, renormalized, times the routed
        scaling factor."""
        gate: Any = self.gate
        logits = torch.nn.functional.linear(hidden_states.float(), gate.weight.float())
        scores = logits.sigmoid()  # [num_tokens, experts]
        choice = scores + gate.e_score_correction_bias
        groups = choice.view(-1, gate.num_group, gate.num_experts // gate.num_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(-1)  # [num_tokens, groups]
        best = group_scores.topk(gate.topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
        choice = groups.masked_fill(~kept[..., None], float("-inf")).flatten(1)
        ids = choice.topk(gate.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if gate.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * gate.routed_scaling_factor, ids

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.run_experts(hidden_states) + self.shared_experts(hidden_states)


class PatchedDeepseekV3DecoderLayer(PatchedLlamaDecoderLayer, DeepseekV3DecoderLayer):
    pass


class PatchedDeepseekV3Model(PatchedLlamaModel, DeepseekV3Model):
    pass


class PatchedDeepseekV3ForCausalLM(PatchedLlamaForCausalLM, DeepseekV3ForCausalLM):
    """Multi-head latent attention over a paged latent cache (absorbed: the cache holds the
    latent and rope key per token), routed experts with shared experts and grouped routing,
    dense first layers."""
