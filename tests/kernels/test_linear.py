"""The CPU linear paths (oneDNN packed, MKL) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmengine.kernels.linear import linear, pack_weight


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 1100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(70, 48, generator=gen)
    bias = torch.randn(70, generator=gen) if with_bias else None
    x = torch.randn(rows, 48, generator=gen)
    out = linear(x, weight, bias, pack_weight(weight))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
