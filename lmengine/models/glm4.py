"""GLM-4: rotary on the first half of each head (`partial_rotary_factor`) and on adjacent
pairs (dims 2i, 2i + 1) rather than halves, gate and up fused in the checkpoint, and a norm
after attention and after the MLP besides Llama's two.
"""

from __future__ import annotations

import torch
from transformers.models.glm4.modeling_glm4 import (
    Glm4Attention,
    Glm4DecoderLayer,
    Glm4ForCausalLM,
    Glm4MLP,
    Glm4Model,
    Glm4RMSNorm,
)

from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaModel,
    PatchedRMSNorm,
)
from lmengine.models.phi3 import FusedGateUpMLP


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, rotary_dim] (each frequency
    twice, halves layout as the HF rotary module makes them). Rotates the pairs (2i, 2i + 1)
    of the first rotary_dim dims by frequency i; the rest passes."""
    rot = cos.shape[-1]
    cos = cos[:, None, : rot // 2].repeat_interleave(2, dim=-1)
    sin = sin[:, None, : rot // 2].repeat_interleave(2, dim=-1)
    x_rot = x[..., :rot]
    turned = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((x_rot * cos + turned * sin, x[..., rot:]), dim=-1)


class PatchedGlm4RMSNorm(PatchedRMSNorm, Glm4RMSNorm):
    pass


class PatchedGlm4MLP(FusedGateUpMLP, Glm4MLP):
    pass


class PatchedGlm4Attention(PatchedLlamaAttention, Glm4Attention):
    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)


class PatchedGlm4DecoderLayer(PatchedLlamaDecoderLayer, Glm4DecoderLayer):
    """Four norms: the residual add is deferred into the post-attention norm and the next
    layer's input norm, as in Llama; the two extra norms apply to the branch outputs."""

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.norm_input(hidden_states, residual)
        hidden_states = self.post_self_attn_layernorm(self.self_attn(hidden_states))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.post_mlp_layernorm(self.mlp(hidden_states)), residual


class PatchedGlm4Model(PatchedLlamaModel, Glm4Model):
    pass


class PatchedGlm4ForCausalLM(PatchedLlamaForCausalLM, Glm4ForCausalLM):
    """Llama with partial rotary on adjacent pairs, gate/up fused in the checkpoint and
    norms after attention and MLP as well as before."""
