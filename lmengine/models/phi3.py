"""Phi-3: q/k/v and gate/up come fused in the checkpoint (`qkv_proj`, `gate_up_proj`), with
optional partial rotary and sliding window from the config.

NOTE: the checkpoint-fused linears stay one PackedLinear each under their HF names (that is
what a peft adapter for Phi-3 targets). They carry `output_sizes` (q, k, v rows; gate, up rows)
like a MergedLinear, so a transform that shards or splits them knows the parts (tensor
parallelism splits each part by heads); they have no `source_names` because transformers never
had separate linears.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.phi3.modeling_phi3 import (
    Phi3Attention,
    Phi3DecoderLayer,
    Phi3ForCausalLM,
    Phi3MLP,
    Phi3Model,
    Phi3RMSNorm,
)

from lmengine.models.attention import PagedAttentionMixin
from lmengine.models.layers import PackedLinear
from lmengine.models.llama import (
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaModel,
    PatchedRMSNorm,
)


class PatchedPhi3RMSNorm(PatchedRMSNorm, Phi3RMSNorm):
    pass


class FusedGateUpMLP:
    """An MLP whose checkpoint holds gate and up as one `gate_up_proj` (gate rows first) with
    `activation_fn` on the gate (Phi-3, GLM-4)."""

    gate_up_proj: PackedLinear
    down_proj: PackedLinear
    activation_fn: nn.Module

    def lmengine_post_patch(self) -> None:
        gate_up = PackedLinear.convert(self.gate_up_proj)
        gate_up.output_sizes = [gate_up.out_features // 2] * 2
        PackedLinear.convert(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return self.down_proj(up * self.activation_fn(gate))


class PatchedPhi3MLP(FusedGateUpMLP, Phi3MLP):
    pass


class PatchedPhi3Attention(PagedAttentionMixin, Phi3Attention):
    def lmengine_post_patch(self) -> None:
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        PackedLinear.convert(self.qkv_proj).output_sizes = [q_size, kv_size, kv_size]
        PackedLinear.convert(self.o_proj)
        self.sliding_window = getattr(self.config, "sliding_window", None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        return self.o_proj(self.paged_attend(q, k, v))


class PatchedPhi3DecoderLayer(PatchedLlamaDecoderLayer, Phi3DecoderLayer):
    pass


class PatchedPhi3Model(PatchedLlamaModel, Phi3Model):
    pass


class PatchedPhi3ForCausalLM(PatchedLlamaForCausalLM, Phi3ForCausalLM):
    """Llama with q/k/v and gate/up fused in the checkpoint; optional partial rotary and
    sliding window."""
