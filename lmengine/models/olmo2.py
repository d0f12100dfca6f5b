"""OLMo 2: no norm before attention or the MLP; an RMSNorm after each instead (before the
residual add), and RMSNorm on the whole q and k projections (all heads at once) before rotary.

The residual add is deferred into the next norm as in Llama, where that norm comes after the
add: the post-attention norm here comes before it, so the layer adds its attention output to
the stream itself and hands the MLP's normed output on.
"""

from __future__ import annotations

import torch
from transformers.models.olmo2.modeling_olmo2 import (
    Olmo2Attention,
    Olmo2DecoderLayer,
    Olmo2ForCausalLM,
    Olmo2MLP,
    Olmo2Model,
    Olmo2RMSNorm,
)

from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
    WeightInFloat32Norm,
)


class PatchedOlmo2RMSNorm(WeightInFloat32Norm, PatchedRMSNorm, Olmo2RMSNorm):
    pass


class PatchedOlmo2MLP(PatchedLlamaMLP, Olmo2MLP):
    pass


class PatchedOlmo2Attention(PatchedLlamaAttention, Olmo2Attention):
    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim]: one RMSNorm over all heads of a token."""
        num_tokens = q.shape[0]
        q_normed = self.q_norm(q.reshape(num_tokens, -1)).view_as(q)
        return q_normed, self.k_norm(k.reshape(num_tokens, -1)).view_as(k)


class PatchedOlmo2DecoderLayer(PatchedLlamaDecoderLayer, Olmo2DecoderLayer):
    """Norms after attention and MLP: returns (normed MLP output, the stream before it)."""

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            hidden_states = hidden_states + residual
        attn = self.post_attention_layernorm(self.self_attn(hidden_states))
        residual = hidden_states + attn
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class PatchedOlmo2Model(PatchedLlamaModel, Olmo2Model):
    pass


class PatchedOlmo2ForCausalLM(PatchedLlamaForCausalLM, Olmo2ForCausalLM):
    """Llama with RMSNorms after attention and MLP instead of before, and RMSNorm over the
    whole q and k projections."""

    # NOTE: under tensor parallelism a rank holds some heads of q and k, and these norms need
    # the sum of squares over all of them (an all-reduce inside the norm). Until the norm does
    # that, this plan makes tp > 1 fail at load time with the reason in the message.
    lmengine_tp_plan: dict[str, str] = {
        "model.layers.*.self_attn.q_proj": "unsupported: OLMo 2's q/k norms span every head, "
        "which one rank does not hold (use tp=1)",
    }
