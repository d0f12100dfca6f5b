"""gpt-oss: attention with a learned sink per head, sliding-window (128) and full layers
alternating, YaRN rotary, biases on every projection, and a mixture of experts with biased
experts and a clamped SwiGLU.

- A sink is a logit with no value: each head's softmax has one more term,
  exp(sink_h - m), in its denominator, so a head can attend to "nothing". The paged kernels
  take the sinks (`paged_attention(..., sinks=)`); everything else about the attention is
  Llama's, through PagedAttentionMixin.
- transformers' gpt-oss rotary module returns one cos/sin per frequency (not twice, as
  Llama's does) and rotates halves with it: the patched model repeats it once, so the shared
  rotary kernels apply.
- transformers stores the experts as gate_up_proj [E, H, 2I] with gate and up columns
  interleaved (gate at even, up at odd), down_proj [E, I, H], and their biases. The block
  rearranges them once, after the weights are loaded, into the batched kernel's layout
  ([E, 2I, H], gate rows first; [E, H, I]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import (
    GptOssAttention,
    GptOssDecoderLayer,
    GptOssForCausalLM,
    GptOssMLP,
    GptOssModel,
    GptOssRMSNorm,
)

from lmengine.kernels.activation import ClampedSwiGLU
from lmengine.kernels.moe import pack_experts
from lmengine.models.context import get_step_context
from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaModel,
    PatchedRMSNorm,
    WeightInFloat32Norm,
)
from lmengine.models.moe import ExpertsMixin


class PatchedGptOssRMSNorm(WeightInFloat32Norm, PatchedRMSNorm, GptOssRMSNorm):
    pass


class PatchedGptOssAttention(PatchedLlamaAttention, GptOssAttention):
    def attention_sinks(self) -> torch.Tensor | None:
        return self.sinks


class PatchedGptOssMLP(ExpertsMixin, GptOssMLP):
    """Top-k of the biased router logits, softmax over those k, then the biased experts with
    the clamped SwiGLU in the batched kernel."""

    def lmengine_post_patch(self) -> None:
        experts = self.experts
        self.act = ClampedSwiGLU(experts.alpha, experts.limit)
        self.packed_experts = None
        self.kernel_layout = False  # set once the experts are rearranged (`_to_kernel_layout`)

    def _to_kernel_layout(self) -> None:
        """The experts in the kernel's layout, in place of transformers' (once, after loading:
        under tensor parallelism the weights arrive after patching)."""
        experts = self.experts

        def gate_rows_first(w: torch.Tensor) -> torch.Tensor:  # [..., 2I] interleaved
            return torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1)

        with torch.no_grad():
            gate_up = gate_rows_first(experts.gate_up_proj).transpose(1, 2).contiguous()
            experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)  # [E, 2I, H]
            bias = gate_rows_first(experts.gate_up_proj_bias).contiguous()
            experts.gate_up_proj_bias = nn.Parameter(bias, requires_grad=False)  # [E, 2I]
            down = experts.down_proj.transpose(1, 2).contiguous()
            experts.down_proj = nn.Parameter(down, requires_grad=False)  # [E, H, I]
        gate_up_packed = pack_experts(experts.gate_up_proj)
        down_packed = pack_experts(experts.down_proj)
        if gate_up_packed is None or down_packed is None:
            self.packed_experts = None
        else:
            self.packed_experts = (gate_up_packed, down_packed)
        self.kernel_layout = True

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router = self.router
        logits = F.linear(hidden_states, router.weight, router.bias)  # [num_tokens, experts]
        top, ids = logits.topk(router.top_k, dim=-1)
        return top.softmax(dim=1), ids

    def expert_act(self) -> ClampedSwiGLU:
        return self.act

    def _fused(self, hidden_states, topk_weights, topk_ids) -> torch.Tensor:
        if not self.kernel_layout:
            self._to_kernel_layout()
        return super()._fused(hidden_states, topk_weights, topk_ids)


class PatchedGptOssDecoderLayer(PatchedLlamaDecoderLayer, GptOssDecoderLayer):
    pass


class PatchedGptOssModel(PatchedLlamaModel, GptOssModel):
    def set_rotary(self, hidden_states: torch.Tensor) -> None:
        ctx = get_step_context()
        cos, sin = self.rotary_emb(hidden_states, ctx.positions[None])  # [1, tokens, d / 2]
        ctx.cos, ctx.sin = torch.cat((cos[0], cos[0]), -1), torch.cat((sin[0], sin[0]), -1)


class PatchedGptOssForCausalLM(PatchedLlamaForCausalLM, GptOssForCausalLM):
    """Attention sinks (a learned logit per head with no value), alternating 128-token
    sliding windows, YaRN rotary, biased projections, MoE with biased experts and a clamped
    SwiGLU."""
