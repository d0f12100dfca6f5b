"""W8A8 with tensor parallelism: the row-parallel linear (o, down), exactly as tp=1 computes it.

A rowwise layer's input is split by columns: each rank sees a [num_tokens, in / tp] shard of a
float activation (attention output, SwiGLU product) that it quantizes per token itself.

- Scales: each rank takes the per-token absmax of its shard and the ranks agree on the
  maximum (one all-reduce of num_tokens floats), so every int8 value and every scale is what
  tp=1 computes.
- Sum: each rank's int8 GEMM gives an exact int32 partial accumulator; the ranks all-reduce
  the int32 accumulators (integer sums are exact and order-free) and then every rank runs the
  same dequantizing epilogue (scales, bias) as tp=1. The output is bit-identical to tp=1 on
  CPU. Summing dequantized float partials instead (the float all-reduce a float rowwise layer
  uses) changes the last bits, and w8a8 amplifies that: a value next to a rounding boundary
  of the following per-token quantization flips by a whole int8 step, and over 30 layers the
  logits drift (see the README's measurement). The int32 all-reduce has the bytes of a float32
  one (twice those of a bf16 one).

`LMENGINE_TP_W8A8_SCALES=local` quantizes each shard with its own absmax and sums float
partials (cheaper, different numbers; for measurement only).
"""

from __future__ import annotations

import os

import torch

from lmengine.distributed.comm import all_reduce, all_reduce_max, get_tp_group
from lmengine.kernels.w8a8 import (
    _MIN_AMAX,
    QMAX,
    int8_gemm,
    int8_mm_cpu,
    int8_mm_ref,
    per_token_quant,
)
from lmengine.models.w8a8 import QuantizedActivation, W8A8Linear

SCALES_ENV = "LMENGINE_TP_W8A8_SCALES"  # "global" (default) or "local"


def quantize_with_amax(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, in] float, amax [num_tokens, 1] f32 (already clamped) -> int8, with the
    rounding of `per_token_quant_ref` (half to even, clamped to +-127)."""
    return torch.round(x.to(torch.float32) * (QMAX / amax)).clamp(-QMAX, QMAX).to(torch.int8)


def int32_accumulate(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """[M, K] int8 @ [N, K].T int8 -> [M, N] int32, exact."""
    if a_q.is_cuda:  # NOTE: untested here (no GPU); torch._int_mm has shape limits on CUDA
        try:
            return torch._int_mm(a_q.contiguous(), w_q.t())
        except RuntimeError:
            return int8_mm_ref(a_q, w_q)
    return int8_mm_cpu(a_q, w_q)


class RowParallelW8A8Linear(W8A8Linear):
    """A W8A8Linear whose input columns (and int8 weight columns) are split over the ranks.
    It all-reduces by itself: every rank returns the whole output. The bias and the
    per-output-channel scales are whole on every rank."""

    local_scales = False  # per-shard input scales (measurement only, see the module doc)
    takes_quantized_input = False

    @classmethod
    def convert(cls, module: W8A8Linear) -> RowParallelW8A8Linear:
        module.__class__ = cls
        module.local_scales = os.environ.get(SCALES_ENV, "global") == "local"
        return module

    def forward(self, x: QuantizedActivation | torch.Tensor) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            raise TypeError("a row-parallel w8a8 linear takes a float input (its shard)")
        if self.local_scales:  # dequantized float partials summed: bias on one rank
            q, scale = per_token_quant(x)
            bias = self.bias if get_tp_group().rank == 0 else None
            return all_reduce(int8_gemm(q, scale, self.weight, self.weight_scale, bias, x.dtype))
        if x.shape[0] == 0:
            return torch.empty(0, self.out_features, dtype=x.dtype, device=x.device)
        amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)  # [num_tokens, 1]
        all_reduce_max(amax).clamp_(min=_MIN_AMAX)
        q = quantize_with_amax(x, amax)  # [num_tokens, in_shard] int8
        acc = all_reduce(int32_accumulate(q, self.weight))  # [num_tokens, out] int32, exact
        # the epilogue of int8_gemm (CPU), on the summed accumulator
        out = torch.mul(acc, amax / QMAX)
        out.mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
