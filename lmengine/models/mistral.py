"""Mistral (sliding-window attention on every layer) and Mixtral (Mistral with a sparse
mixture-of-experts feed-forward).

Mistral's attention reads the window from the config instead of an attribute; the patch copies
it onto the module so PagedAttentionMixin passes it to the kernels. Mixtral's experts stay the
3-D parameters transformers loads (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]); the router is one [E, H] weight. Neither is an nn.Linear, so linear transforms
(TP, LoRA, w8a8) do not see them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

from lmengine.kernels.moe import fused_moe, pack_experts
from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)


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


class PatchedMixtralSparseMoeBlock(MixtralSparseMoeBlock):
    """Top-k softmax routing as transformers does it, then the batched expert kernel."""

    def lmengine_post_patch(self) -> None:
        """Pack each expert's weights for the CPU GEMMs (float32; None elsewhere). Whoever
        changes the expert weights afterwards calls this again."""
        gate_up = pack_experts(self.experts.gate_up_proj)
        down = pack_experts(self.experts.down_proj)
        self.packed_experts = None if gate_up is None or down is None else (gate_up, down)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(hidden_states, self.gate.weight)  # [num_tokens, num_experts]
        probs = router_logits.float().softmax(-1)
        topk_weights, topk_ids = probs.topk(self.top_k, dim=-1)  # [num_tokens, top_k]
        topk_weights /= topk_weights.sum(-1, keepdim=True)
        experts = self.experts
        return fused_moe(
            hidden_states,
            experts.gate_up_proj,
            experts.down_proj,
            topk_weights,
            topk_ids,
            experts.act_fn,
            self.packed_experts,
        )


class PatchedMixtralDecoderLayer(PatchedLlamaDecoderLayer, MixtralDecoderLayer):
    pass


class PatchedMixtralModel(PatchedLlamaModel, MixtralModel):
    pass


class PatchedMixtralForCausalLM(PatchedLlamaForCausalLM, MixtralForCausalLM):
    """Mistral with a top-k mixture of experts (batched expert kernel: CPU grouped by
    expert, Triton grouped GEMM)."""
