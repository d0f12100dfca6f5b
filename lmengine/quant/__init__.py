"""Quantization applied after patching: W8A8 SmoothQuant (`lmengine quantize w8a8`) and the
blocks of a GGUF file (`quant_policy="gguf"`)."""

from __future__ import annotations

import torch

from lmengine.quant.w8a8 import apply_w8a8_policy, quantize_checkpoint, quantize_model

__all__ = ["apply_quant_policy", "quantize_checkpoint", "quantize_model"]


def apply_quant_policy(model, engine_config):
    """Called by the ModelAgent right after patching: what `quant_policy` (or a w8a8
    checkpoint) asks of the patched model. A model loaded from a GGUF file computes on its
    blocks unless `quant_policy="float"` (or the model runs in another dtype or on CUDA, where
    the float32 expansion stays the default: `gguf_blocks_by_default`)."""
    gguf_file = getattr(model, "lmengine_gguf_file", None)
    policy = engine_config.quant_policy
    if policy == "gguf" or (policy is None and gguf_blocks_by_default(model, gguf_file)):
        from lmengine.quant.gguf import apply_gguf

        return apply_gguf(model, gguf_file, required=policy == "gguf")
    return apply_w8a8_policy(model, engine_config)


def gguf_blocks_by_default(model, gguf_file: str | None) -> bool:
    """Whether a model with no quant_policy computes on its GGUF file's blocks: when it came
    from one and runs in float32 on the CPU, where the block kernels are measured (docs/gguf.md).
    """
    if gguf_file is None:
        return False
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32
