"""GPT-NeoX (Pythia): parallel residual (attention and MLP both read the layer input), partial
rotary (`partial_rotary_factor`), LayerNorm, GELU MLP, biased linears, q/k/v fused in the
checkpoint as one `query_key_value` laid out per head ([heads, 3, head_dim] rows).

NOTE: `query_key_value` stays one PackedLinear (its HF name, what peft targets); because the
rows interleave q, k, v per head, a tensor-parallel split by heads keeps whole heads together.
"""

from __future__ import annotations

import torch
from transformers.models.gpt_neox.modeling_gpt_neox import (
    GPTNeoXAttention,
    GPTNeoXForCausalLM,
    GPTNeoXLayer,
    GPTNeoXMLP,
    GPTNeoXModel,
)

from lmengine.models.attention import PagedAttentionMixin, set_rotary
from lmengine.models.context import get_step_context
from lmengine.models.layers import PackedLinear
from lmengine.models.llama import PatchedLlamaForCausalLM


class PatchedGPTNeoXAttention(PagedAttentionMixin, GPTNeoXAttention):
    def lmengine_post_patch(self) -> None:
        self.head_dim = self.head_size
        PackedLinear.convert(self.query_key_value)
        PackedLinear.convert(self.dense)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.query_key_value(hidden_states).view(num_tokens, -1, 3 * self.head_dim)
        q, k, v = qkv.chunk(3, dim=-1)  # [num_tokens, heads, head_dim] each
        return self.dense(self.paged_attend(q, k, v))


class PatchedGPTNeoXMLP(GPTNeoXMLP):
    def lmengine_post_patch(self) -> None:
        PackedLinear.convert(self.dense_h_to_4h)
        PackedLinear.convert(self.dense_4h_to_h)


class PatchedGPTNeoXLayer(GPTNeoXLayer):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(hidden_states))
        if self.use_parallel_residual:
            mlp = self.mlp(self.post_attention_layernorm(hidden_states))
            return mlp + attn + hidden_states
        attn = attn + hidden_states
        return self.mlp(self.post_attention_layernorm(attn)) + attn


class PatchedGPTNeoXModel(GPTNeoXModel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden_states = self.embed_in(input_ids)  # [num_tokens, hidden]
        set_rotary(self.rotary_emb, hidden_states)
        hooks = get_step_context().hooks
        if hooks is not None:
            hooks.after_layer(0, hidden_states)
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers], 1):
            hidden_states = layer(hidden_states)
            if hooks is not None:
                hooks.after_layer(i, hidden_states)
        hidden_states = self.final_layer_norm(hidden_states)
        if hooks is not None:
            hooks.after_norm(hidden_states)
        return hidden_states


class PatchedGPTNeoXForCausalLM(PatchedLlamaForCausalLM, GPTNeoXForCausalLM):
    """Parallel residual, partial rotary, LayerNorm, GELU, per-head fused q/k/v."""

    # NOTE: the Llama patch comes first in the MRO, so HF class attributes that differ must
    # be restated here (transformers finds the backbone by base_model_prefix)
    base_model_prefix = GPTNeoXForCausalLM.base_model_prefix
    backbone_name = "gpt_neox"
