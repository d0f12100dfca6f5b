"""SwiGLU's silu(gate) * up: the compiled CPU pass against the reference, and the dispatch."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.activation import silu_mul, silu_mul_compiled, silu_mul_ref


@pytest.mark.parametrize("rows", [1, 7, 130])  # 130 rows of 2 x 1536: split over threads
def test_silu_mul_compiled_matches_reference(rows):
    assert cpu_ext.load() is not None, "the compiled CPU kernels did not build"
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4.0
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp saturating both ways
    out = silu_mul(gate_up)
    assert silu_mul_compiled(gate_up) is not None  # the compiled path served it
    assert out.shape == (rows, 1536) and out.dtype == torch.float32
    torch.testing.assert_close(out, silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)


def test_silu_mul_column_slice_and_fallbacks():
    """A column slice (rows contiguous, stride > width) is taken as is; other dtypes (float16;
    bfloat16 has its own kernel, tests/kernels/test_bf16_ops.py) and an odd width run the
    reference."""
    wide = torch.randn(5, 2 * 64 + 3)
    gate_up = wide[:, 3:]
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)
    half = gate_up.to(torch.float16)
    assert silu_mul_compiled(half) is None
    torch.testing.assert_close(silu_mul(half), silu_mul_ref(half), rtol=0, atol=0)
    transposed = torch.randn(64, 6).t()  # rows not contiguous
    assert silu_mul_compiled(transposed) is None
    torch.testing.assert_close(silu_mul(transposed), silu_mul_ref(transposed), rtol=0, atol=0)
