"""Linear layers on CPU through oneDNN with weights pre-packed once.

Measured on this project's 2-core CPU, float32, weights streamed from memory as in a real
forward: oneDNN on pre-packed weights runs the GEMMs of a 64-token decode step 1.5x faster than
the default (MKL) path and those of a 16-token step 3x faster; for one token (a GEMV) MKL is
~20 % faster, and from ~1k rows (large prefills) MKL wins again, so those keep using it.
Elsewhere (CUDA, other dtypes, a torch without oneDNN) `linear` is `F.linear`, which is also
the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACK_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows
_MIN_ROWS_FOR_PACKED = 2  # a single row is a GEMV: MKL is faster
_MAX_ROWS_FOR_PACKED = 1023  # from ~1k rows (large prefills) MKL is faster again


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of `weight` [out, in], or None where packing does not apply."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [num_tokens, in] -> [num_tokens, out]; `packed` from `pack_weight(weight)`."""
    if packed is None or not _MIN_ROWS_FOR_PACKED <= x.shape[0] <= _MAX_ROWS_FOR_PACKED:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
