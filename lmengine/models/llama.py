"""Llama patched for paged, packed execution.

The whole batch is one packed token sequence without padding: hidden states are
[num_tokens, hidden]. Attention writes this step's K/V into the paged cache and reads the
history through the StepContext. The LM head runs only on the rows that are sampled.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
)

from lmengine.kernels import add_rms_norm, rms_norm
from lmengine.kernels.activation import silu_mul
from lmengine.models.attention import PagedAttentionMixin, set_rotary
from lmengine.models.context import KeptRows, StepContext, get_step_context, kept_rows
from lmengine.models.decode_loop import (
    LayerClasses,
    any_forward_hooks,
    run_decode_layers,
    same_methods,
)
from lmengine.models.layers import PackedLinear, merge_linears


class PatchedRMSNorm(LlamaRMSNorm):
    """RMSNorm, optionally fused with the residual add before it."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)
        return add_rms_norm(x, residual, self.weight, self.variance_epsilon)


class WeightInFloat32Norm:
    """Mixed in before PatchedRMSNorm for norms that multiply the weight into the float32
    normalised row and round once (transformers' OLMo 2 and gpt-oss norms; Llama's rounds the
    row first). The same as PatchedRMSNorm in float32, where there is nothing to round."""

    weight: torch.Tensor
    variance_epsilon: float

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            return super().forward(x, residual)  # type: ignore[misc]
        summed = x if residual is None else residual + x  # rounded, as transformers adds
        xf = summed.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = (self.weight.float() * normed).to(x.dtype)
        return out if residual is None else (out, summed)


class PatchedLlamaMLP(LlamaMLP):
    """SwiGLU with gate and up projections fused into one GEMM."""

    def lmengine_post_patch(self) -> None:
        merge_linears(self, "gate_up_proj", ["gate_proj", "up_proj"])
        PackedLinear.convert(self.down_proj)

    def fuses_silu_mul(self, gate_up: torch.Tensor) -> bool:
        """True when act_fn(gate) * up is SwiGLU's silu product over [gate | up] halves of
        `gate_up`, so that one fused op (`silu_mul`) can compute it."""
        return (
            isinstance(self.act_fn, (SiLUActivation, nn.SiLU))
            and self.gate_up_proj.output_sizes[0] * 2 == gate_up.shape[-1]
        )

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2 * intermediate] -> act_fn(gate) * up [num_tokens, intermediate]."""
        if self.fuses_silu_mul(gate_up):
            return silu_mul(gate_up)
        gate, up = self.gate_up_proj.split(gate_up)
        return self.act_fn(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_mul(self.gate_up_proj(x)))


class PatchedLlamaAttention(PagedAttentionMixin, LlamaAttention):
    def lmengine_post_patch(self) -> None:
        merge_linears(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
        PackedLinear.convert(self.o_proj)

    def forward(self, hidden_states: torch.Tensor, kept: KeptRows | None = None) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]; with `kept`, every token's K and V go
        to the cache and the kept rows alone come out: [num_kept, hidden]."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))  # [num_tokens, q/k/v size]
        return self.o_proj(self.paged_attend(q, k, v, kept=kept))


class PatchedLlamaDecoderLayer(LlamaDecoderLayer):
    def norm_input(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_layernorm, fused with the residual add the previous layer deferred.
        Returns (normed input, residual stream)."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        return self.input_layernorm(hidden_states, residual)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kept: KeptRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With `kept` (the last layer, `kept_rows`), the kept rows alone after attention; with
        none kept, the K and V written and two empty tensors."""
        hidden_states, residual = self.norm_input(hidden_states, residual)
        if kept is None:
            hidden_states = self.self_attn(hidden_states)
        else:
            hidden_states, residual = self.self_attn(hidden_states, kept), residual[kept.rows]
            if kept.meta is None:
                return residual, residual  # [0, hidden]: nothing after attention is read
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


# what the compiled decode loop runs in place of these modules (models/decode_loop.py)
LLAMA_LAYER = LayerClasses(
    PatchedLlamaDecoderLayer, PatchedLlamaAttention, PatchedLlamaMLP, PatchedRMSNorm
)


def _kept_rows(layer: nn.Module, ctx: StepContext) -> KeptRows | None:
    """The rows the last layer may run alone (`kept_rows`: the logits rows), or None: when a
    research hook, an adapter or a forward hook would see the others, or `layer` is not the
    patched Llama layer with its attention as here (its MLP and norms work row by row)."""
    if ctx.hooks is not None or ctx.lora is not None:
        return None
    attn = getattr(layer, "self_attn", None)
    plain = (
        same_methods(layer, PatchedLlamaDecoderLayer, "forward", "norm_input")
        and same_methods(attn, PatchedLlamaAttention, "forward")
        and same_methods(attn, PagedAttentionMixin, "paged_attend")
    )
    if not plain or any_forward_hooks(layer.modules()):
        return None
    return kept_rows(ctx)


class PatchedLlamaModel(LlamaModel):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden] (Granite overrides: scaled)."""
        return self.embed_tokens(input_ids)

    def set_rotary(self, hidden_states: torch.Tensor) -> None:
        """Put this step's cos/sin into the step context (Gemma 3 overrides: one pair per
        layer type)."""
        set_rotary(self.rotary_emb, hidden_states)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden_states = self.embed(input_ids)  # [num_tokens, hidden]
        self.set_rotary(hidden_states)
        ctx = get_step_context()
        hooks = ctx.hooks  # research hooks: None unless a request asks
        if hooks is not None:
            hooks.after_layer(0, hidden_states)
        layers = self.layers[: self.config.num_hidden_layers]
        # the last layer on the logits rows alone, where nothing reads the others
        kept = _kept_rows(layers[-1], ctx) if layers else None
        # every layer in one compiled call where the step and the layers allow, else None
        looped = run_decode_layers(layers, hidden_states, ctx, self, LLAMA_LAYER, kept)
        if looped is not None:
            hidden_states, residual = looped
        else:
            residual = None
            for i, layer in enumerate(layers, 1):
                if kept is not None and i == len(layers):
                    hidden_states, residual = layer(hidden_states, residual, kept)
                else:
                    hidden_states, residual = layer(hidden_states, residual)
                if hooks is not None:
                    hooks.after_layer(i, hidden_states, residual)
        ctx.logits_rows_only = kept is not None
        hidden_states, _ = self.norm(hidden_states, residual)
        if hooks is not None:
            hooks.after_norm(hidden_states)
        return hidden_states


class PatchedLlamaForCausalLM(LlamaForCausalLM):
    """RMSNorm, rotary, GQA, SwiGLU (SmolLM2 and any LlamaForCausalLM)."""

    backbone_name = "model"  # attribute holding the patched base model

    def lmengine_post_patch(self) -> None:
        PackedLinear.convert(self.lm_head)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> logits of the sampled rows [num_samples, vocab]."""
        hidden_states = getattr(self, self.backbone_name)(input_ids)
        ctx = get_step_context()
        if not ctx.logits_rows_only:
            hidden_states = hidden_states[ctx.logits_indices]
        return self.lm_head(hidden_states).float()
