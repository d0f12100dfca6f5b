"""RMSNorm: CPU dispatch vs reference vs transformers' LlamaRMSNorm, and the Triton launcher."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lmengine.kernels import add_rms_norm, cpu_ext, rms_norm
from lmengine.kernels.rms_norm import add_rms_norm_ref, rms_norm_ref

EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_rows, hidden): one row, a hidden size that is not a power of two, a typical width
SHAPES = [(1, 8), (5, 100), (3, 256)]
# Triton vs reference. float16/bfloat16: the normalised row is rounded to the input dtype before
# the weight multiply, so a last-bit difference in rsqrt or in the sum order can flip that
# rounding (one ulp), and the product rounds again. The Triton interpreter also casts float32 to
# bfloat16 by truncation instead of round-to-nearest-even (triton 3.9), adding up to one more ulp.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def _inputs(shape, dtype, seed, weight_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(shape[-1], generator=gen)).to(weight_dtype or dtype)
    return x, residual, weight


def _llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    module = LlamaRMSNorm(weight.shape[0], eps=eps)
    with torch.no_grad():
        module.weight = torch.nn.Parameter(weight.clone())
        return module(x)


# --- CPU dispatch path -------------------------------------------------------------------------


# float32 and bfloat16 on the CPU run the compiled kernels, which sum the squares in their own
# order: a few ulp from the reference in float32; in bfloat16, which rounds where the reference
# rounds, a last-bit difference can flip the rounding of the normalised row (one step) and the
# weight product rounds again: two bfloat16 steps (2**-6 relative) at most. float16 runs the
# reference's own ops: bit-exact.
CPU_TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 2**-6, "atol": 0}}
EXACT = {"rtol": 0, "atol": 0}
# more rows than one task takes (the kernel splits rows over threads from ~228 of width 576)
CPU_SHAPES = SHAPES + [(64, 576), (300, 576)]


def _cpu_tol(dtype):
    if dtype in CPU_TOL:
        assert cpu_ext.load() is not None, "the compiled CPU kernels did not build"
    return CPU_TOL.get(dtype, EXACT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rms_norm_cpu_matches_reference_and_transformers(dtype, shape, seed):
    x, _, weight = _inputs(shape, dtype, seed)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    tol = _cpu_tol(dtype)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **tol)
    torch.testing.assert_close(out, _llama_rms_norm(x, weight, EPS), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_add_rms_norm_cpu_matches_reference_and_transformers(dtype, shape):
    x, residual, weight = _inputs(shape, dtype, seed=2)
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    ref_normed, ref_summed = add_rms_norm_ref(x, residual, weight, EPS)
    tol = _cpu_tol(dtype)
    torch.testing.assert_close(summed, ref_summed, **EXACT)  # one add per element either way
    torch.testing.assert_close(summed, residual + x, **EXACT)
    torch.testing.assert_close(normed, ref_normed, **tol)
    torch.testing.assert_close(normed, _llama_rms_norm(residual + x, weight, EPS), **tol)


def test_rms_norm_cpu_three_dim_and_strided_inputs():
    """A [tokens, heads, dim] input (per-head q/k norms) normalises each last-dim row; a
    non-contiguous float32 input takes torch's fused RMSNorm, bit-exact to the reference."""
    x, residual, weight = _inputs((6, 4, 32), torch.float32, seed=4)
    out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **_cpu_tol(torch.float32))
    strided = x.transpose(0, 1)
    torch.testing.assert_close(
        rms_norm(strided, weight, EPS), rms_norm_ref(strided, weight, EPS), **EXACT
    )
    normed, summed = add_rms_norm(strided, residual.transpose(0, 1), weight, EPS)
    ref_normed, ref_summed = add_rms_norm_ref(strided, residual.transpose(0, 1), weight, EPS)
    torch.testing.assert_close(normed, ref_normed, **EXACT)
    torch.testing.assert_close(summed, ref_summed, **EXACT)


def test_rms_norm_cpu_extreme_rows():
    """Large and tiny magnitudes and an all-zero row (eps keeps it finite) on the compiled
    path."""
    x = torch.randn(4, 576)
    x[0] *= 1e18
    x[1] *= 1e-18
    x[2] = 0.0
    weight = torch.rand(576) + 0.5
    out = rms_norm(x, weight, EPS)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **_cpu_tol(torch.float32))


def test_rms_norm_cpu_float32_weight_promotes_like_transformers():
    x, _, weight = _inputs((4, 64), torch.bfloat16, seed=3, weight_dtype=torch.float32)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _llama_rms_norm(x, weight, EPS), rtol=0, atol=0)


def test_rms_norm_cpu_rejects_mismatched_weight():
    x, _, weight = _inputs((2, 16), torch.float32, seed=0)
    with pytest.raises(ValueError, match="hidden size"):
        rms_norm(x, weight[:8], EPS)
    with pytest.raises(ValueError, match="hidden size"):
        add_rms_norm(x, x, weight[:8], EPS)


# --- Triton launcher ---------------------------------------------------------------------------

TRITON_SHAPES = [(1, 1), (1, 8), (5, 100), (3, 256), (2, 8200)]  # 8200 > MAX_BLOCK: two passes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_rms_norm_triton_matches_reference(triton_device, dtype, shape):
    from lmengine.kernels.triton.rms_norm import MAX_BLOCK, rms_norm_triton

    if shape[1] > MAX_BLOCK:
        assert shape[1] % MAX_BLOCK != 0  # the multi-pass case must also have a ragged tail
    x, _, weight = _inputs(shape, dtype, seed=shape[1])
    expected = rms_norm_ref(x, weight, EPS)
    out = rms_norm_triton(x.to(triton_device), weight.to(triton_device), EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_add_rms_norm_triton_matches_reference(triton_device, triton_interpreted, dtype, shape):
    from lmengine.kernels.triton.rms_norm import add_rms_norm_triton

    x, residual, weight = _inputs(shape, dtype, seed=shape[0] + shape[1])
    ref_normed, ref_summed = add_rms_norm_ref(x, residual, weight, EPS)
    dev = triton_device
    normed, summed = add_rms_norm_triton(x.to(dev), residual.to(dev), weight.to(dev), EPS)
    if dtype == torch.bfloat16 and triton_interpreted:
        # interpreter truncates float32 -> bfloat16: the sum may be one ulp off
        torch.testing.assert_close(summed.cpu(), ref_summed, rtol=8e-3, atol=1e-5)
    else:
        torch.testing.assert_close(summed.cpu(), ref_summed, rtol=0, atol=0)
    torch.testing.assert_close(normed.cpu(), ref_normed, **TOL[dtype])


def test_rms_norm_triton_mixed_weight_dtype_and_strided_rows(triton_device):
    from lmengine.kernels.triton.rms_norm import rms_norm_triton

    x, _, weight = _inputs((4, 96), torch.bfloat16, seed=5, weight_dtype=torch.float32)
    x_wide = torch.zeros(4, 128, dtype=torch.bfloat16)
    x_wide[:, :96] = x
    strided = x_wide.to(triton_device)[:, :96]  # row stride 128
    out = rms_norm_triton(strided, weight.to(triton_device), EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), rms_norm_ref(x, weight, EPS), **TOL[torch.bfloat16])


def test_rms_norm_triton_3d_input(triton_device):
    from lmengine.kernels.triton.rms_norm import rms_norm_triton

    x, _, weight = _inputs((2, 3, 32), torch.float32, seed=6)
    out = rms_norm_triton(x.to(triton_device), weight.to(triton_device), EPS)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out.cpu(), rms_norm_ref(x, weight, EPS), **TOL[torch.float32])


def test_rms_norm_triton_rejects_bad_inputs(triton_device):
    from lmengine.kernels.triton.rms_norm import add_rms_norm_triton, rms_norm_triton

    dev = triton_device
    x = torch.randn(4, 16, device=dev)
    w = torch.ones(16, device=dev)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(x, torch.ones(8, device=dev), EPS)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm_triton(x.to(torch.int32), w, EPS)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm_triton(x.double(), w.double(), EPS)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        rms_norm_triton(torch.randn(16, 4, device=dev).t(), w, EPS)
    with pytest.raises(ValueError, match="cannot be viewed"):
        rms_norm_triton(torch.randn(2, 4, 32, device=dev)[:, :3, :16], w, EPS)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rms_norm_triton(x, torch.ones(32, device=dev)[::2], EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_triton(x, x[:2], w, EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_triton(x, x.half(), w, EPS)
