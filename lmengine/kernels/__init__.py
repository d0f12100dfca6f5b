"""Tensor kernels: each op has a PyTorch reference (`*_ref`), a fast CPU path and, on CUDA, a
Triton kernel (`lmengine.kernels.triton`). The public function of each module dispatches on the
device of its inputs. Kernels import only torch and triton."""

from __future__ import annotations

from lmengine.kernels.fill_kv_cache import fill_kv_cache, rotary_fill_kv_cpu
from lmengine.kernels.paged_attention import AttentionMetadata, paged_attention
from lmengine.kernels.rms_norm import add_rms_norm, rms_norm
from lmengine.kernels.rotary import apply_rotary

__all__ = [
    "AttentionMetadata",
    "add_rms_norm",
    "apply_rotary",
    "fill_kv_cache",
    "paged_attention",
    "rms_norm",
    "rotary_fill_kv_cpu",
]
