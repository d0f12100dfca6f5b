"""SmolLM3: Llama whose config leaves rotary out of some layers (`no_rope_layers[i] == 0`,
every fourth layer in the released models). transformers sets `use_rope` on each attention;
the patch turns it into "no rotary" for PagedAttentionMixin.
"""

from __future__ import annotations

import torch
from transformers.models.smollm3.modeling_smollm3 import (
    SmolLM3Attention,
    SmolLM3DecoderLayer,
    SmolLM3ForCausalLM,
    SmolLM3MLP,
    SmolLM3Model,
    SmolLM3RMSNorm,
)

from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)


class PatchedSmolLM3RMSNorm(PatchedRMSNorm, SmolLM3RMSNorm):
    pass


class PatchedSmolLM3MLP(PatchedLlamaMLP, SmolLM3MLP):
    pass


class PatchedSmolLM3Attention(PatchedLlamaAttention, SmolLM3Attention):
    def rotary(self, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
        return super().rotary(ctx) if self.use_rope else None


class PatchedSmolLM3DecoderLayer(PatchedLlamaDecoderLayer, SmolLM3DecoderLayer):
    pass


class PatchedSmolLM3Model(PatchedLlamaModel, SmolLM3Model):
    pass


class PatchedSmolLM3ForCausalLM(PatchedLlamaForCausalLM, SmolLM3ForCausalLM):
    """Llama with rotary left out of the layers the config names (`no_rope_layers`)."""
