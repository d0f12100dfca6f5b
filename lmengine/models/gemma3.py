"""Gemma 3 (text): Gemma 2's layer (four (1 + w) norms, scaled embeddings, GeGLU) with per-head
q/k norms, local (sliding-window) and global layers interleaved, each kind with its own rotary
base, and no attention soft-cap by default.

The patched model computes one cos/sin pair per layer type into the step context; each
attention picks its own by `layer_type`, so local and global layers run in one batch.
"""

from __future__ import annotations

import torch
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3MLP,
    Gemma3RMSNorm,
    Gemma3TextModel,
)

from lmengine.models.attention import PerHeadQKNorm
from lmengine.models.context import get_step_context
from lmengine.models.gemma2 import (
    PatchedGemma2DecoderLayer,
    PatchedGemma2ForCausalLM,
    PatchedGemma2RMSNorm,
)
from lmengine.models.llama import PatchedLlamaAttention, PatchedLlamaMLP, PatchedLlamaModel


class PatchedGemma3RMSNorm(PatchedGemma2RMSNorm, Gemma3RMSNorm):
    pass


class PatchedGemma3MLP(PatchedLlamaMLP, Gemma3MLP):
    pass


class PatchedGemma3Attention(PerHeadQKNorm, PatchedLlamaAttention, Gemma3Attention):
    def rotary(self, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
        return ctx.rotary_by_type[self.layer_type]


class PatchedGemma3DecoderLayer(PatchedGemma2DecoderLayer, Gemma3DecoderLayer):
    pass


class PatchedGemma3TextModel(PatchedLlamaModel, Gemma3TextModel):
    def lmengine_post_patch(self) -> None:
        if getattr(self.config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention (an embedding model) is not a "
                "causal LM: lmengine runs only causal attention"
            )

    def set_rotary(self, hidden_states: torch.Tensor) -> None:
        ctx = get_step_context()
        positions = ctx.positions[None]
        ctx.rotary_by_type = {}
        for layer_type in sorted(set(self.config.layer_types)):
            cos, sin = self.rotary_emb(hidden_states, positions, layer_type)
            ctx.rotary_by_type[layer_type] = (cos[0], sin[0])


class PatchedGemma3ForCausalLM(PatchedGemma2ForCausalLM, Gemma3ForCausalLM):
    """Gemma 2's layer with per-head q/k norms and local/global layers (5:1 in the released
    models) on different rotary bases."""
