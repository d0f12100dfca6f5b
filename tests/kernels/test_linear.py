"""The CPU linear paths (compiled small GEMM, oneDNN packed, MKL) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext
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


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features", [1, 4, 7, 130])
def test_small_gemm_matches_f_linear(rows, out_features):
    module = cpu_ext.load()
    assert module is not None, "the CPU kernels failed to build"
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 33, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, 33, generator=gen)
    torch.testing.assert_close(module.small_gemm(x, weight, bias), F.linear(x, weight, bias))
    torch.testing.assert_close(module.small_gemm(x, weight), F.linear(x, weight))
    with pytest.raises(RuntimeError, match="do not match"):
        module.small_gemm(x, weight[:, :5].contiguous())
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        module.small_gemm(torch.randn(5, 33), weight)
