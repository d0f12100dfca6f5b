"""Qwen2 (biased q/k/v projections) and Qwen3 (per-head RMSNorm on q and k before rotary).

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

from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)


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


class PatchedQwen3Attention(PatchedLlamaAttention, Qwen3Attention):
    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim]: RMSNorm over head_dim, per head. q and k are
        column slices of the fused projection; contiguous copies let the Triton norm view
        them as rows."""
        return self.q_norm(q.contiguous()), self.k_norm(k.contiguous())


class PatchedQwen3DecoderLayer(PatchedLlamaDecoderLayer, Qwen3DecoderLayer):
    pass


class PatchedQwen3Model(PatchedLlamaModel, Qwen3Model):
    pass


class PatchedQwen3ForCausalLM(PatchedLlamaForCausalLM, Qwen3ForCausalLM):
    """Llama with per-head RMSNorm on q and k; optional sliding-window layers."""
