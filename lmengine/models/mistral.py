"""Mistral (sliding-window attention on every layer) and Mixtral (Mistral with a sparse
mixture-of-experts feed-forward).

Mistral's attention reads the window from the config instead of an attribute; the patch copies
it onto the module so PagedAttentionMixin passes it to the kernels. Mixtral's experts run as
models/moe.py describes.
"""

from __future__ import annotations

import torch
from transformers.models.mistral.modeling_mistral import (
    MistralAttention,
    MistralDecoderLayer,
    MistralForCausalLM,
    MistralMLP,
    MistralModel,
    MistralRMSNorm,
)
from transformers.models.mixtral.modeling_mixtral import (
    MixtralAttention,
    MixtralDecoderLayer,
    MixtralForCausalLM,
    MixtralModel,
    MixtralRMSNorm,
    MixtralSparseMoeBlock,
)

from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)
from lmengine.models.moe import ExpertsMixin, softmax_top_k


class PatchedMistralRMSNorm(PatchedRMSNorm, MistralRMSNorm):
    pass


class PatchedMistralMLP(PatchedLlamaMLP, MistralMLP):
    pass


class PatchedMistralAttention(PatchedLlamaAttention, MistralAttention):
    def lmengine_post_patch(self) -> None:
        super().lmengine_post_patch()
        self.sliding_window = getattr(self.config, "sliding_window", None)


class PatchedMistralDecoderLayer(PatchedLlamaDecoderLayer, MistralDecoderLayer):
    pass


class PatchedMistralModel(PatchedLlamaModel, MistralModel):
    pass


class PatchedMistralForCausalLM(PatchedLlamaForCausalLM, MistralForCausalLM):
    """Llama with sliding-window attention (in the paged kernels)."""


class PatchedMixtralRMSNorm(PatchedRMSNorm, MixtralRMSNorm):
    pass


class PatchedMixtralAttention(PatchedMistralAttention, MixtralAttention):
    pass


class PatchedMixtralSparseMoeBlock(ExpertsMixin, MixtralSparseMoeBlock):
    """Top-k softmax routing as transformers does it, then the batched expert kernel."""

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_top_k(self.gate, hidden_states, normalize=True)


class PatchedMixtralDecoderLayer(PatchedLlamaDecoderLayer, MixtralDecoderLayer):
    pass


class PatchedMixtralModel(PatchedLlamaModel, MixtralModel):
    pass


class PatchedMixtralForCausalLM(PatchedLlamaForCausalLM, MixtralForCausalLM):
    """Mistral with a top-k mixture of experts (batched expert kernel: CPU grouped by
    expert, Triton grouped GEMM)."""
