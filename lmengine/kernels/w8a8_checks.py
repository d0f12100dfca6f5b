"""Input checks of the W8A8 ops, shared by the references and CPU paths
(`lmengine.kernels.w8a8`) and the Triton launchers (`lmengine.kernels.triton.w8a8`), which add
their own layout checks on top; it imports neither."""

from __future__ import annotations

import torch


def check_rows(x: torch.Tensor, op: str) -> None:
    """x must be a 2-D float tensor [num_tokens, hidden]; ValueError naming `op` if not."""
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{op}: x must be a float tensor, got {x.dtype}")


def check_gemm(
    a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, op: str
) -> None:
    """a_q [M, K] and w_q [N, K] int8, a_scale [M, 1], w_scale [N]; ValueError naming `op`."""
    if a_q.dtype != torch.int8 or w_q.dtype != torch.int8:
        raise ValueError(f"{op}: a_q and w_q must be int8, got {a_q.dtype} and {w_q.dtype}")
    if a_q.dim() != 2 or w_q.dim() != 2 or a_q.shape[1] != w_q.shape[1]:
        raise ValueError(
            f"{op}: a_q must be [M, K] and w_q [N, K], got {tuple(a_q.shape)} and "
            f"{tuple(w_q.shape)}"
        )
    if a_scale.shape != (a_q.shape[0], 1) or w_scale.shape != (w_q.shape[0],):
        raise ValueError(
            f"{op}: a_scale must be [{a_q.shape[0]}, 1] and w_scale [{w_q.shape[0]}], got "
            f"{tuple(a_scale.shape)} and {tuple(w_scale.shape)}"
        )
