"""Llama patched for paged, packed execution.

The whole batch is one packed token sequence without padding: hidden states are
[num_tokens, hidden]. Attention writes this step's K/V into the paged cache and reads the
history through the StepContext. The LM head runs only on the rows that are sampled.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
)

from lmengine.kernels import add_rms_norm, apply_rotary, fill_kv_cache, paged_attention, rms_norm
from lmengine.kernels.linear import linear, linear_module, pack_module, pack_weight
from lmengine.models.context import get_step_context


class PatchedRMSNorm(LlamaRMSNorm):
    """RMSNorm, optionally fused with the residual add before it."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)
        return add_rms_norm(x, residual, self.weight, self.variance_epsilon)


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the weights (and biases) of linears sharing an input into one matrix, and make
    each linear's parameters views into it: one GEMM instead of several, no extra memory."""
    weight = torch.cat([lin.weight.detach() for lin in linears], 0)  # [sum_out, in]
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):
        parts = [
            lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features)
            for lin in linears
        ]
        bias = torch.cat(parts)
    offset = 0
    for lin, with_bias in zip(linears, has_bias):
        rows = slice(offset, offset + lin.out_features)
        lin.weight = nn.Parameter(weight[rows], requires_grad=False)
        if with_bias:
            lin.bias = nn.Parameter(bias[rows], requires_grad=False)
        offset += lin.out_features
    return weight, bias


class PatchedLlamaMLP(LlamaMLP):
    """SwiGLU with gate and up projections fused into one GEMM."""

    def lmengine_post_patch(self) -> None:
        self.gate_up_weight, self.gate_up_bias = fuse_linears([self.gate_proj, self.up_proj])
        self.gate_up_packed = pack_weight(self.gate_up_weight)
        pack_module(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, 2 * intermediate]
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear_module(self.down_proj, self.act_fn(gate) * up)


class PatchedLlamaAttention(LlamaAttention):
    def lmengine_post_patch(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.qkv_sizes = [self.q_proj.out_features, self.k_proj.out_features]
        self.qkv_sizes.append(self.v_proj.out_features)
        self.qkv_packed = pack_weight(self.qkv_weight)
        pack_module(self.o_proj)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        ctx = get_step_context()
        num_tokens = hidden_states.shape[0]
        # [num_tokens, q + k + v]
        qkv = linear(hidden_states, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        # [num_tokens, heads, head_dim] and [num_tokens, kv_heads, head_dim]
        q = q.view(num_tokens, -1, self.head_dim)
        k = k.view(num_tokens, -1, self.head_dim)
        v = v.view(num_tokens, -1, self.head_dim)
        q, k = apply_rotary(q, k, ctx.cos, ctx.sin)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        fill_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, ctx.attn_meta, self.scaling)
        return linear_module(self.o_proj, out.view(num_tokens, -1))


class PatchedLlamaDecoderLayer(LlamaDecoderLayer):
    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class PatchedLlamaModel(LlamaModel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        ctx = get_step_context()
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary_emb(hidden_states, ctx.positions[None])  # [1, num_tokens, d]
        ctx.cos, ctx.sin = cos[0], sin[0]
        residual = None
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, residual = layer(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class PatchedLlamaForCausalLM(LlamaForCausalLM):
    def lmengine_post_patch(self) -> None:
        pack_module(self.lm_head)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> logits of the sampled rows [num_samples, vocab]."""
        hidden_states = self.model(input_ids)
        hidden_states = hidden_states[get_step_context().logits_indices]
        return linear_module(self.lm_head, hidden_states).float()
