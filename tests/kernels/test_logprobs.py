"""The compiled per-row log-sum-exp / maximum kernel against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.logprobs import logsumexp_max_rows, logsumexp_max_rows_ref


@pytest.mark.skipif(cpu_ext.load() is None, reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("vocab", [1, 7, 49152])
def test_kernel_equals_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=g) * 8
    x[3, vocab // 2] = 1e4  # a dominant logit
    x[5] = -float("inf")  # nothing possible
    x[6, 0] = float("nan")
    x[7] = 2.5  # a full tie: the first index
    rows = torch.tensor([0, 3, 5, 6, 7, 39, 3, 12])
    lse, best, at = logsumexp_max_rows(x, rows)
    want_lse, want_best, want_at = logsumexp_max_rows_ref(x, rows)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(best[rows != 6], want_best[rows != 6])
    assert torch.equal(at[rows != 6], want_at[rows != 6])
    assert torch.isnan(lse[rows == 6]).all()
    # a logprob and the top entry of the same row are the same float when they coincide
    top = x[rows, at] - lse
    assert torch.equal(top[rows == 3], (best - lse)[rows == 3])


def test_rows_out_of_range_are_refused():
    if cpu_ext.load() is None:
        pytest.skip("no C++ compiler for the CPU kernels")
    with pytest.raises(RuntimeError, match="out of range"):
        logsumexp_max_rows(torch.zeros(2, 4), torch.tensor([2]))
