"""W8A8 kernels on bfloat16 activations, and the AMX-INT8 GEMM.

- The AMX-INT8 GEMM (oneDNN's brgemm microkernel on a weight packed for the tiles): its int32
  accumulators against an exact integer reference, compared exactly (unit scales, float32
  output: every accumulator here is below 2^24, so its float32 value is exact too), over row
  counts across the row tiles, column counts across the weight blocks and full-range values;
  with scales and bias bit-identical to `int8_gemm_ref` in float32 and bfloat16.
- Per-token quantization of bfloat16 rows: bit-identical to the reference (compiled and eager).
- The int8 GEMM's epilogue into bfloat16 (`_int_mm`, oneDNN's packed weight, the one-call
  float-input linear): bit-identical to `int8_gemm_ref(..., out_dtype=torch.bfloat16)`.
- RMSNorm + quantization and SwiGLU + quantization of bfloat16 rows: the residual sum exact,
  the int8 values within one step of the reference on rounding boundaries (the norm's sum of
  squares and silu's exp differ from torch's in the last bits, as in float32).
"""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_ext, cpu_features
from lmengine.kernels.activation import silu_mul_ref
from lmengine.kernels.w8a8 import (
    AMX_MIN_ROWS,
    int8_gemm,
    int8_gemm_ref,
    int8_mm_ref,
    pack_int8_weight,
    pack_int8_weight_amx,
    per_token_quant,
    per_token_quant_ref,
    rms_norm_quant,
    rms_norm_quant_ref,
    silu_mul_quant_cpu,
    w8a8_linear_cpu,
)

BF16 = torch.bfloat16
EPS = 1e-6


def _int8(shape, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


def _rows(shape, seed=0, dtype=BF16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[:, 0] *= 20.0  # an outlier channel
    return x.to(dtype)


def _scales(m, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(m, 1, generator=gen) + 1e-3, torch.rand(n, generator=gen) + 1e-3


@pytest.fixture(scope="module")
def amx() -> bool:
    """Whether the AMX-INT8 GEMM runs here; where it does not, packing must refuse."""
    assert cpu_ext.load() is not None, "the compiled CPU kernels did not build"
    has = pack_int8_weight_amx(_int8((16, 64), 0)) is not None
    assert has == ("amx_int8" in cpu_features.cpu_flags())
    return has


# ---- the AMX-INT8 GEMM ------------------------------------------------------------------


@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 16, 64),  # one row (decode)
        (2, 48, 64),
        (5, 70, 100),  # N not a multiple of the 64-channel blocks
        (129, 130, 200),  # M one past a 128-row tile
        (300, 960, 576),  # SmolLM2's q/k/v
        (64, 576, 1536),  # SmolLM2's down projection
    ],
)
def test_amx_int8_gemm_accumulators_are_exact(amx, m, n, k):
    if not amx:
        pytest.skip("no AMX-INT8 on this CPU")
    a, w = _int8((m, k), 1), _int8((n, k), 2)
    full = slice(0, min(k, 1024))  # full-range rows and columns: the largest sums of either
    a[0, full] = 127  # sign that float32 still holds exactly (1,024 * 127^2 < 2^24)
    a[-1, full] = -127 if m > 1 else 127
    w[0, full] = 127
    w[-1, full] = -127
    packed = pack_int8_weight_amx(w)
    acc = int8_mm_ref(a, w)  # [M, N] int32, computed in int64
    assert acc.abs().max() < 2**24  # so float32 holds every accumulator exactly
    ones_m, ones_n = torch.ones(m, 1), torch.ones(n)
    out = int8_gemm(a, ones_m, w, ones_n, packed_amx=packed)
    assert out.dtype == torch.float32
    assert torch.equal(out.to(torch.int64), acc.to(torch.int64))
    assert torch.equal(out, acc.to(torch.float32))


@pytest.mark.parametrize("m", [AMX_MIN_ROWS, 2, 7, 128, 257])
@pytest.mark.parametrize("out_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("has_bias", [False, True])
def test_amx_int8_gemm_with_epilogue_is_the_reference(amx, m, out_dtype, has_bias):
    if not amx:
        pytest.skip("no AMX-INT8 on this CPU")
    n, k = 200, 96
    a, w = _int8((m, k), 3), _int8((n, k), 4)
    a_scale, w_scale = _scales(m, n, 5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(out_dtype)
    bias = bias if has_bias else None
    packed = pack_int8_weight_amx(w)
    out = int8_gemm(a, a_scale, w, w_scale, bias, out_dtype, packed_amx=packed)
    assert out.dtype == out_dtype
    assert torch.equal(out, int8_gemm_ref(a, a_scale, w, w_scale, bias, out_dtype))


def test_amx_pack_refuses_what_the_gemm_cannot_take(amx):
    assert pack_int8_weight_amx(_int8((16, 66), 0)) is None  # K not a multiple of 4
    assert pack_int8_weight_amx(torch.zeros(16, 64)) is None  # not int8


# ---- quantization and epilogue in bfloat16 ------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8), (5, 100), (64, 576)])
def test_per_token_quant_of_bfloat16_rows_is_the_reference(shape, cpu_path):
    x = _rows(shape, seed=shape[0])
    x[-1] = 0  # an all-zero row quantizes to zeros with a finite scale
    q, scale = per_token_quant(x)
    q_ref, scale_ref = per_token_quant_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("m", [1, 2, 33])
@pytest.mark.parametrize("has_bias", [False, True])
def test_bfloat16_epilogue_is_the_reference(m, has_bias, cpu_path):
    """`_int_mm` (one row) and oneDNN's packed weight (2 rows on), the int8 input and the
    one-call bfloat16-input linear: the float32 epilogue rounded once to bfloat16."""
    n, k = 70, 100
    a, w = _int8((m, k), 7), _int8((n, k), 8)
    a_scale, w_scale = _scales(m, n, 9)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(10)).to(BF16)
    bias = bias if has_bias else None
    ref = int8_gemm_ref(a, a_scale, w, w_scale, bias, BF16)
    for packed in (None, pack_int8_weight(w)):
        assert torch.equal(int8_gemm(a, a_scale, w, w_scale, bias, BF16, packed), ref)
    x = _rows((m, k), seed=m)
    out = w8a8_linear_cpu(x, w, w_scale, bias, pack_int8_weight(w))
    if cpu_path == "eager":
        assert out is None
    else:
        assert out.dtype == BF16
        assert torch.equal(out, int8_gemm_ref(*per_token_quant_ref(x), w, w_scale, bias, BF16))


def _assert_within_one_step(q, scale, q_ref, scale_ref):
    """Values that sit on a rounding boundary may land one int8 step away; scales within the
    float32 rounding of the row maximum (a bfloat16 value, so they are equal unless the
    maximum itself moved by one bfloat16 step)."""
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.02
    torch.testing.assert_close(scale, scale_ref, rtol=8e-3, atol=0)
    assert (scale == scale_ref).float().mean() >= 0.9


@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (64, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_of_bfloat16_rows(shape, with_residual, cpu_path):
    gen = torch.Generator().manual_seed(11)
    x = _rows(shape, seed=12)
    residual = torch.randn(shape, generator=gen).to(BF16) if with_residual else None
    weight = (1.0 + 0.5 * torch.randn(shape[-1], generator=gen)).to(BF16)
    q, scale, summed = rms_norm_quant(x, weight, EPS, residual)
    q_ref, scale_ref, summed_ref = rms_norm_quant_ref(x, weight, EPS, residual)
    _assert_within_one_step(q, scale, q_ref, scale_ref)
    if with_residual:
        assert summed.dtype == BF16 and torch.equal(summed, summed_ref)
    else:
        assert summed is None


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_quant_of_bfloat16_rows(rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 3
    gate_up = gate_up.to(BF16)
    q, scale = silu_mul_quant_cpu(gate_up)
    q_ref, scale_ref = per_token_quant_ref(silu_mul_ref(gate_up))
    _assert_within_one_step(q, scale, q_ref, scale_ref)
    # a column slice of a wider output (rows not contiguous) gives the same
    wide = torch.cat([gate_up, gate_up[:, :64]], dim=1)[:, : 2 * 1536]
    q2, scale2 = silu_mul_quant_cpu(wide)
    assert torch.equal(q2, q) and torch.equal(scale2, scale)
