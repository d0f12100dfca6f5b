"""Per-row log-sum-exp and maximum of selected logits rows: what prompt scoring needs.

`logsumexp_max_rows(x, rows)` -> (lse [K], max [K], argmax [K]) of rows `rows` of x [M, N]:
a logprob is then `logit - lse` without writing the [K, N] log-softmax. The compiled CPU
kernel (two vectorised passes per row, no row copy) runs on float32 CPU tensors; the
reference below everywhere else, and the tests compare the two.
"""

from __future__ import annotations

import torch

from lmengine.kernels import cpu_ext

_BLOCK_ROWS = 512  # rows per block of the reference: bounds its [block, N] temporaries


def logsumexp_max_rows_ref(
    x: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse, best, at = [], [], []
    for start in range(0, rows.shape[0], _BLOCK_ROWS):
        block = x.index_select(0, rows[start : start + _BLOCK_ROWS]).float()  # [b, N]
        lse.append(torch.logsumexp(block, -1))
        values, ids = block.max(-1)
        best.append(values)
        at.append(ids)
    if not lse:
        empty = x.new_empty(0, dtype=torch.float32)
        return empty, empty.clone(), torch.empty(0, dtype=torch.long, device=x.device)
    return torch.cat(lse), torch.cat(best), torch.cat(at)


def logsumexp_max_rows(
    x: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp, maximum, first index of the maximum) of rows `rows` [K] of x [M, N]."""
    if x.dtype == torch.float32 and not x.is_cuda and x.is_contiguous() and x.dim() == 2:
        ext = cpu_ext.load()
        if ext is not None and x.shape[1] > 0:
            lse, best, at = ext.logsumexp_max_rows(x, rows.long().contiguous())
            return lse, best, at
    return logsumexp_max_rows_ref(x, rows)
