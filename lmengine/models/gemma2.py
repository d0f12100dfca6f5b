"""Gemma 2: soft-capped attention logits and final logits, sliding-window attention on every
other layer, embeddings scaled by sqrt(hidden), GeGLU, RMSNorm scaled by (1 + weight), and four
norms per layer (before and after both attention and MLP).

The scaled embedding is transformers' own module (it multiplies in its forward) and needs no
patch. The attention is Llama's with the two per-layer attributes transformers sets
(`sliding_window` only on sliding layers, `attn_logit_softcapping`) and Gemma's
`query_pre_attn_scalar` already in `scaling`.
"""

from __future__ import annotations

import torch
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2MLP,
    Gemma2Model,
    Gemma2RMSNorm,
)

from lmengine.kernels import add_rms_norm, rms_norm
from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
)


class PatchedGemma2RMSNorm(Gemma2RMSNorm):
    """x / rms(x) * (1 + weight), optionally fused with the residual add before it."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # NOTE: made per call (a [hidden] add), not at patch time: under tensor parallelism
        # the weights are still on the meta device when the model is patched
        scale = (1.0 + self.weight.float()).to(x.dtype)
        if residual is None:
            return rms_norm(x, scale, self.eps)
        return add_rms_norm(x, residual, scale, self.eps)


class PatchedGemma2MLP(PatchedLlamaMLP, Gemma2MLP):
    pass


class PatchedGemma2Attention(PatchedLlamaAttention, Gemma2Attention):
    pass


class PatchedGemma2DecoderLayer(PatchedLlamaDecoderLayer, Gemma2DecoderLayer):
    """Sandwich norms. The residual add is deferred into the next norm, as in Llama: returns
    (this layer's output, the residual stream before it)."""

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.norm_input(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class PatchedGemma2Model(PatchedLlamaModel, Gemma2Model):
    pass


class PatchedGemma2ForCausalLM(PatchedLlamaForCausalLM, Gemma2ForCausalLM):
    """Soft-capped attention and final logits, sliding window on alternate layers, scaled
    embeddings, GeGLU, (1 + weight) RMSNorms, four norms per layer."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> soft-capped logits [num_samples, vocab]."""
        logits = super().forward(input_ids)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
