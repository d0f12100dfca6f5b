"""Qwen2 (biased q/k/v projections), Qwen3 (per-head RMSNorm on q and k before rotary) and
Qwen3-MoE (Qwen3 with top-k routed experts in place of the MLP, in the layers the config makes
sparse).

Both are Llama with a twist: the Llama patches are reused by subclassing (the patched Llama
class first, then the HF class it replaces, which `patch` requires). Qwen2's biases need no
code: MergedLinear stacks them. Layers that the config marks "sliding_attention" carry
`sliding_window`, which PagedAttentionMixin hands to the kernels.
"""

from __future__ import annotations

import torch
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2ForCausalLM,
    Qwen2MLP,
    Qwen2Model,
    Qwen2RMSNorm,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
    Qwen3MLP,
    Qwen3Model,
    Qwen3RMSNorm,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeMLP,
    Qwen3MoeModel,
    Qwen3MoeRMSNorm,
    Qwen3MoeSparseMoeBlock,
)

from lmengine.models.attention import PerHeadQKNorm
from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)
from lmengine.models.moe import ExpertsMixin, softmax_top_k


class PatchedQwen2RMSNorm(PatchedRMSNorm, Qwen2RMSNorm):
    pass


class PatchedQwen2MLP(PatchedLlamaMLP, Qwen2MLP):
    pass


class PatchedQwen2Attention(PatchedLlamaAttention, Qwen2Attention):
    pass


class PatchedQwen2DecoderLayer(PatchedLlamaDecoderLayer, Qwen2DecoderLayer):
    pass


class PatchedQwen2Model(PatchedLlamaModel, Qwen2Model):
    pass


class PatchedQwen2ForCausalLM(PatchedLlamaForCausalLM, Qwen2ForCausalLM):
    """Llama with biased q/k/v projections; optional sliding-window layers."""


class PatchedQwen3RMSNorm(PatchedRMSNorm, Qwen3RMSNorm):
    pass


class PatchedQwen3MLP(PatchedLlamaMLP, Qwen3MLP):
    pass


class PatchedQwen3Attention(PerHeadQKNorm, PatchedLlamaAttention, Qwen3Attention):
    pass


class PatchedQwen3DecoderLayer(PatchedLlamaDecoderLayer, Qwen3DecoderLayer):
    pass


class PatchedQwen3Model(PatchedLlamaModel, Qwen3Model):
    pass


class PatchedQwen3ForCausalLM(PatchedLlamaForCausalLM, Qwen3ForCausalLM):
    """Llama with per-head RMSNorm on q and k; optional sliding-window layers."""


class PatchedQwen3MoeRMSNorm(PatchedRMSNorm, Qwen3MoeRMSNorm):
    pass


class PatchedQwen3MoeMLP(PatchedLlamaMLP, Qwen3MoeMLP):
    pass


class PatchedQwen3MoeSparseMoeBlock(ExpertsMixin, Qwen3MoeSparseMoeBlock):
    """Softmax over the experts, the top k, renormalized when the config says
    (`norm_topk_prob`), then the batched expert kernel."""

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_top_k(self.gate, hidden_states, normalize=self.gate.norm_topk_prob)


class PatchedQwen3MoeAttention(PerHeadQKNorm, PatchedLlamaAttention, Qwen3MoeAttention):
    pass


class PatchedQwen3MoeDecoderLayer(PatchedLlamaDecoderLayer, Qwen3MoeDecoderLayer):
    pass


class PatchedQwen3MoeModel(PatchedLlamaModel, Qwen3MoeModel):
    pass


class PatchedQwen3MoeForCausalLM(PatchedLlamaForCausalLM, Qwen3MoeForCausalLM):
    """Qwen3 with top-k routed experts (batched expert kernel) in the sparse layers and a
    dense MLP in the others (`mlp_only_layers`, `decoder_sparse_step`)."""
