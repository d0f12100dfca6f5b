"""Quantization applied after patching: W8A8 SmoothQuant (`lmengine quantize w8a8`) and the
blocks of a GGUF file (`quant_policy="gguf"`)."""

from __future__ import annotations

from lmengine.quant.w8a8 import apply_w8a8_policy, quantize_checkpoint, quantize_model

__all__ = ["apply_quant_policy", "quantize_checkpoint", "quantize_model"]


def apply_quant_policy(model, engine_config):
    """Called by the ModelAgent right after patching: what `quant_policy` (or a w8a8
    checkpoint) asks of the patched model."""
    if engine_config.quant_policy == "gguf":
        from lmengine.quant.gguf import apply_gguf, check_engine_support

        gguf_file = getattr(model, "lmengine_gguf_file", None)
        check_engine_support(engine_config, gguf_file)
        return apply_gguf(model, gguf_file)
    return apply_w8a8_policy(model, engine_config)
