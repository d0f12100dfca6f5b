"""Quantization applied after patching: W8A8 SmoothQuant (`lmengine quantize w8a8`)."""

from __future__ import annotations

from lmengine.quant.w8a8 import apply_quant_policy, quantize_checkpoint, quantize_model

__all__ = ["apply_quant_policy", "quantize_checkpoint", "quantize_model"]
