"""W8A8 with tensor parallelism: the row-parallel linear (o, down) quantizes its input shard
with the per-token scale of the whole input.

A rowwise layer's input is split by columns: each rank sees a [num_tokens, in / tp] shard of a
float activation (attention output, SwiGLU product) that it quantizes per token itself. With
the absmax of its own shard only ("local" scales), each rank would round differently from
tp=1. Instead the ranks take the maximum over all ranks (one all-reduce of num_tokens floats,
tiny next to the all-reduce of the [num_tokens, hidden] output), so every int8 value and
every scale is what tp=1 computes: only the order of the float sums of the partial outputs
differs. `LMENGINE_TP_W8A8_SCALES=local` switches to per-shard scales (measurement only; the
README gives the difference).
"""

from __future__ import annotations

import os

import torch

from lmengine.distributed.comm import all_reduce_max
from lmengine.kernels.w8a8 import _MIN_AMAX, QMAX, int8_gemm
from lmengine.models.w8a8 import QuantizedActivation, W8A8Linear

SCALES_ENV = "LMENGINE_TP_W8A8_SCALES"  # "global" (default) or "local"


def quantize_with_amax(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, in] float, amax [num_tokens, 1] f32 (already clamped) -> int8, with the
    rounding of `per_token_quant_ref` (half to even, clamped to +-127)."""
    return torch.round(x.to(torch.float32) * (QMAX / amax)).clamp(-QMAX, QMAX).to(torch.int8)


class RowParallelW8A8Linear(W8A8Linear):
    """A W8A8Linear whose input columns are split over the ranks (the output is all-reduced by
    a hook, added by `shard_model`)."""

    local_scales = False  # per-shard input scales (measurement only, see the module doc)

    @classmethod
    def convert(cls, module: W8A8Linear) -> RowParallelW8A8Linear:
        module.__class__ = cls
        module.local_scales = os.environ.get(SCALES_ENV, "global") == "local"
        return module

    def forward(self, x: QuantizedActivation | torch.Tensor) -> torch.Tensor:
        if isinstance(x, QuantizedActivation) or self.local_scales:
            return super().forward(x)
        amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)  # [num_tokens, 1]
        all_reduce_max(amax).clamp_(min=_MIN_AMAX)
        q = quantize_with_amax(x, amax)  # [num_tokens, in_shard] int8
        return int8_gemm(q, amax / QMAX, self.weight, self.weight_scale, self.bias, x.dtype)
