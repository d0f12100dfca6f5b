"""Granite: Llama with four scalars from the config: embeddings times `embedding_multiplier`,
each attention and MLP output times `residual_multiplier` before its residual add, attention
scores times `attention_multiplier` (transformers already puts it in `scaling`), and logits
divided by `logits_scaling`.
"""

from __future__ import annotations

import torch
from transformers.models.granite.modeling_granite import (
    GraniteAttention,
    GraniteDecoderLayer,
    GraniteForCausalLM,
    GraniteMLP,
    GraniteModel,
    GraniteRMSNorm,
)

from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)


class PatchedGraniteRMSNorm(PatchedRMSNorm, GraniteRMSNorm):
    pass


class PatchedGraniteMLP(PatchedLlamaMLP, GraniteMLP):
    pass


class PatchedGraniteAttention(PatchedLlamaAttention, GraniteAttention):
    pass


class PatchedGraniteDecoderLayer(PatchedLlamaDecoderLayer, GraniteDecoderLayer):
    """Llama's layer with both branch outputs scaled before their residual adds."""

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.residual_multiplier
        hidden_states, residual = self.norm_input(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states) * scale
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * scale, residual


class PatchedGraniteModel(PatchedLlamaModel, GraniteModel):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class PatchedGraniteForCausalLM(PatchedLlamaForCausalLM, GraniteForCausalLM):
    """Llama with embedding, residual, attention and logits multipliers."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) / self.config.logits_scaling
