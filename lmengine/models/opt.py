"""OPT: learned absolute positions (table offset by 2), LayerNorm, ReLU MLP, biased
projections, pre- or post-norm (`do_layer_norm_before`), optional project_in/out.

No rotary: the model leaves cos/sin unset, so PagedAttentionMixin skips it. Queries are scaled
before the product, as transformers does, and the kernels then use scale 1.
"""

from __future__ import annotations

import torch
from transformers.models.opt.modeling_opt import (
    OPTAttention,
    OPTDecoder,
    OPTDecoderLayer,
    OPTForCausalLM,
    OPTModel,
)

from lmengine.models.attention import PagedAttentionMixin
from lmengine.models.context import get_step_context
from lmengine.models.layers import PackedLinear, merge_linears
from lmengine.models.llama import PatchedLlamaForCausalLM


class PatchedOPTAttention(PagedAttentionMixin, OPTAttention):
    def lmengine_post_patch(self) -> None:
        merge_linears(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
        PackedLinear.convert(self.out_proj)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))  # [num_tokens, hidden]
        return self.out_proj(self.paged_attend(q * self.scaling, k, v, scale=1.0))


class PatchedOPTDecoderLayer(OPTDecoderLayer):
    def lmengine_post_patch(self) -> None:
        PackedLinear.convert(self.fc1)
        PackedLinear.convert(self.fc2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        pre_norm = self.do_layer_norm_before
        residual = hidden_states
        if pre_norm:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states)
        if not pre_norm:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if pre_norm:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        if not pre_norm:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class PatchedOPTDecoder(OPTDecoder):
    def lmengine_post_patch(self) -> None:
        for proj in (self.project_in, self.project_out):
            if proj is not None:
                PackedLinear.convert(proj)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> final hidden states [num_tokens, word_embed_proj_dim]."""
        positions = get_step_context().positions + self.embed_positions.offset  # [num_tokens]
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        hidden_states = hidden_states + self.embed_positions.weight[positions]
        hooks = get_step_context().hooks
        if hooks is not None:
            hooks.after_layer(0, hidden_states)
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers], 1):
            hidden_states = layer(hidden_states)
            if hooks is not None:
                hooks.after_layer(i, hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        if hooks is not None:
            hooks.after_norm(hidden_states)
        return hidden_states


class PatchedOPTModel(OPTModel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids)


class PatchedOPTForCausalLM(PatchedLlamaForCausalLM, OPTForCausalLM):
    """Learned positions (offset 2), LayerNorm, ReLU, biases, pre- or post-norm,
    project_in/out."""
