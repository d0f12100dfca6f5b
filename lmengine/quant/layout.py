"""Where the quantizable linears of each architecture sit, by HF causal-LM class name.

Shared by the quantizer (`lmengine.quant.w8a8`) and the checkpoint reader
(`lmengine.quant.checkpoint`); it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class W8A8Layout:
    """Where the quantizable linears of one architecture are, and how smoothing folds.

    Paths are relative to one decoder layer, names as the patched model has them. A layout
    only names modules; it never touches weights.
    """

    layers: str  # path of the ModuleList of decoder layers
    norm_groups: tuple[tuple[str, str], ...]  # (RMSNorm, the linear it feeds)
    # (producer linear, its part, consumer linear): the consumer's input is linear in the
    # producer part's output channels (attention mixes tokens, SwiGLU multiplies elementwise),
    # so its smoothing scales fold into the producer's rows
    row_groups: tuple[tuple[str, str, str], ...]


_LLAMA_LAYOUT = W8A8Layout(
    layers="model.layers",
    norm_groups=(
        ("input_layernorm", "self_attn.qkv_proj"),
        ("post_attention_layernorm", "mlp.gate_up_proj"),
    ),
    row_groups=(
        ("self_attn.qkv_proj", "v_proj", "self_attn.o_proj"),
        ("mlp.gate_up_proj", "up_proj", "mlp.down_proj"),
    ),
)

# HF causal-LM class name -> layout. An architecture gets w8a8 by adding its layout here (and
# its RMSNorm/linear classes to W8A8_MODULE_MAP if they differ from Llama's).
W8A8_LAYOUTS: dict[str, W8A8Layout] = {"LlamaForCausalLM": _LLAMA_LAYOUT}


def get_layout(model: nn.Module) -> W8A8Layout:
    """The layout of `model` (patched or not); ValueError listing the supported ones if none."""
    # NOTE: by name, not by subclassing: patches of other architectures may subclass the
    # Llama patches, so a Llama class in the MRO says nothing about the checkpoint's layout
    name = getattr(model, "lmengine_architecture", None) or type(model).__name__
    if name in W8A8_LAYOUTS:
        return W8A8_LAYOUTS[name]
    raise ValueError(
        f"w8a8 quantization is not supported for architecture {name}; "
        f"supported: {', '.join(sorted(W8A8_LAYOUTS))}"
    )
