"""W8A8 kernels: per-token quantization, fused RMSNorm + quantization, int8 GEMM.

CPU path and Triton launcher (interpreter) against the PyTorch references. Accumulators are
compared exactly (int32); dequantized results within the tolerances stated at each assert.
"""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels.rms_norm import rms_norm_ref
from lmengine.kernels.w8a8 import (
    int8_gemm,
    int8_gemm_ref,
    int8_mm_cpu,
    int8_mm_ref,
    pack_int8_weight,
    pack_int8_weight_amx,
    per_token_quant,
    per_token_quant_ref,
    rms_norm_quant,
    rms_norm_quant_ref,
    w8a8_linear_cpu,
)

EPS = 1e-6
ROW_SHAPES = [(1, 8), (5, 100), (3, 256)]  # one row, hidden not a power of two, typical
# (M, N, K): one row (decode), M not a multiple of the tile, K not a multiple of BLOCK_K
GEMM_SHAPES = [(1, 48, 64), (5, 70, 100), (33, 130, 200)]


def _rows(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[:, 0] *= 20.0  # an outlier channel, as real activations have
    return x.to(dtype)


def _int8(shape, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


# ---- per-token quantization ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_quant_reference_properties(shape, dtype):
    x = _rows(shape, dtype)
    q, scale = per_token_quant_ref(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (shape[0], 1)
    # the largest |x| of each row maps to +-127, and nothing reaches -128
    assert (q.abs().amax(dim=1) == 127).all() and (q != -128).all()
    # round to nearest: the dequantized value is within half a step of x
    err = (q.float() * scale - x.float()).abs()
    assert (err <= scale / 2 * (1 + 1e-5)).all()


def test_per_token_quant_zero_row_is_finite():
    q, scale = per_token_quant_ref(torch.zeros(2, 16))
    assert (q == 0).all() and torch.isfinite(scale).all() and (scale > 0).all()


@pytest.mark.parametrize("shape", ROW_SHAPES + [(64, 1536)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_token_quant_cpu_is_reference(shape, seed, cpu_path):
    x = _rows(shape, seed=seed)
    x[-1] = 0.0  # an all-zero row
    q, scale = per_token_quant(x)
    q_ref, scale_ref = per_token_quant_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


# a row wider than the kernel's one-block limit (MAX_BLOCK, 8,192): walked in blocks, the last
# one ragged (Llama-7B's down_proj input is 11,008 wide)
WIDE_ROWS = [(2, 8200)]


@pytest.mark.parametrize("shape", [*ROW_SHAPES, *WIDE_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_quant_triton(triton_device, shape, dtype):
    from lmengine.kernels.triton.w8a8 import per_token_quant_triton

    x = _rows(shape, dtype).to(triton_device)
    q, scale = per_token_quant_triton(x)
    q_ref, scale_ref = per_token_quant_ref(x)
    # same float32 operations in the same order (a max is order-free): bit-exact
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_round_half_to_even_in_triton(triton_device):
    """Exact ties (x * 127 / amax = k + 0.5) round to even, as torch.round does."""
    from lmengine.kernels.triton.w8a8 import per_token_quant_triton

    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0]], device=triton_device)
    q, _ = per_token_quant_triton(x)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3]]
    assert torch.equal(q, per_token_quant_ref(x)[0])


# ---- RMSNorm + quantization ---------------------------------------------------------------------


def _norm_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + 100)
    x = _rows(shape, dtype, seed)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_reference_is_norm_then_quant(shape, with_residual):
    x, residual, weight = _norm_inputs(shape, torch.float32)
    q, scale, summed = rms_norm_quant_ref(x, weight, EPS, residual if with_residual else None)
    src = residual + x if with_residual else x
    q_expected, scale_expected = per_token_quant_ref(rms_norm_ref(src, weight, EPS))
    assert torch.equal(q, q_expected) and torch.equal(scale, scale_expected)
    assert (summed is None) == (not with_residual)
    if with_residual:
        assert torch.equal(summed, src)


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_cpu_is_reference(shape, with_residual, cpu_path):
    x, residual, weight = _norm_inputs(shape, torch.float32, seed=1)
    res = residual if with_residual else None
    q, scale, summed = rms_norm_quant(x, weight, EPS, res)
    q_ref, scale_ref, summed_ref = rms_norm_quant_ref(x, weight, EPS, res)
    if cpu_path == "eager":
        # torch.rms_norm is bit-identical to the reference in float32 (test_rms_norm)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    else:  # one pass: the sum of squares in another order, as the Triton kernel
        _assert_norm_quant_close(q, scale, q_ref, scale_ref, rtol=1e-5)
    if with_residual:
        assert torch.equal(summed, summed_ref)


def _assert_norm_quant_close(q, scale, q_ref, scale_ref, rtol):
    """A norm reduced in another order than the reference: last-bit differences in rstd, so a
    value on a rounding boundary may land one int8 step away; scales within `rtol`."""
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.02
    torch.testing.assert_close(scale, scale_ref, rtol=rtol, atol=0)


def test_rms_norm_quant_compiled_on_a_decode_batch(cpu_path):
    """SmolLM2's shape (64 rows of 576): the compiled kernel against the reference, and a
    norm with its weight 1 % off must fail the same check."""
    x, residual, weight = _norm_inputs((64, 576), torch.float32, seed=3)
    q, scale, summed = rms_norm_quant(x, weight, EPS, residual)
    q_ref, scale_ref, summed_ref = rms_norm_quant_ref(x, weight, EPS, residual)
    _assert_norm_quant_close(q, scale, q_ref, scale_ref, rtol=1e-5)
    assert torch.equal(summed, summed_ref)
    q_bad, scale_bad, _ = rms_norm_quant_ref(x, weight * 1.01, EPS, residual)
    with pytest.raises(AssertionError):
        _assert_norm_quant_close(q_bad, scale_bad, q_ref, scale_ref, rtol=1e-5)


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_quant_triton(triton_device, shape, with_residual, dtype):
    from lmengine.kernels.triton.w8a8 import rms_norm_quant_triton

    x, residual, weight = _norm_inputs(shape, dtype, seed=2)
    x, residual, weight = x.to(triton_device), residual.to(triton_device), weight.to(triton_device)
    res = residual if with_residual else None
    q, scale, summed = rms_norm_quant_triton(x, weight, EPS, res)
    q_ref, scale_ref, summed_ref = rms_norm_quant_ref(x, weight, EPS, res)
    # The sum of squares is reduced in another order (float32: last-bit differences in rstd;
    # float16: also the weight product stays float32 here): a value sitting on a rounding
    # boundary may land one step away. Scales within 1e-5 relative (float32), one float16 ulp.
    _assert_norm_quant_close(q, scale, q_ref, scale_ref, 1e-5 if dtype == torch.float32 else 1e-3)
    if with_residual:
        assert torch.equal(summed, summed_ref)  # the add rounds to the input dtype, as torch


# ---- int8 GEMM ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", GEMM_SHAPES)
def test_int8_mm_cpu_exact(shape):
    m, n, k = shape
    a, w = _int8((m, k), 0), _int8((n, k), 1)
    acc = int8_mm_cpu(a, w)
    assert acc.dtype == torch.int32 and torch.equal(acc, int8_mm_ref(a, w))


def test_int8_mm_extreme_values_do_not_overflow():
    """All products at +-127^2: the int32 accumulator holds K * 16129 exactly."""
    k = 4096
    a = torch.full((3, k), 127, dtype=torch.int8)
    w = torch.full((5, k), -127, dtype=torch.int8)
    expected = torch.full((3, 5), -127 * 127 * k, dtype=torch.int32)
    assert torch.equal(int8_mm_ref(a, w), expected)
    assert torch.equal(int8_mm_cpu(a, w), expected)


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_cpu_matches_reference(shape, has_bias, out_dtype, cpu_path):
    m, n, k = shape
    gen = torch.Generator().manual_seed(3)
    a, w = _int8((m, k), 0), _int8((n, k), 1)
    a_scale, w_scale = torch.rand(m, 1, generator=gen), torch.rand(n, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    out = int8_gemm(a, a_scale, w, w_scale, bias, out_dtype)
    ref = int8_gemm_ref(a, a_scale, w, w_scale, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    # same accumulator, same float32 epilogue in the same order: bit-exact
    assert torch.equal(out, ref)
    # and it is the float product of the dequantized operands, up to float32 rounding
    dense = (a.double() * a_scale.double()) @ (w.double() * w_scale.double()[:, None]).t()
    if bias is not None:
        dense += bias.double()
    rtol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), dense.to(out_dtype).double(), rtol=rtol, atol=1e-3)


@pytest.mark.parametrize("shape", GEMM_SHAPES + [(0, 16, 32)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_fused_float_input_linear_is_quant_then_gemm(shape, has_bias):
    """The one-call linear on a float input equals quantize-then-GEMM of the references."""
    m, n, k = shape
    x = _rows((m, k), seed=4) if m else torch.zeros(0, k)
    w, w_scale = _int8((n, k), 5), torch.rand(n, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(n) if has_bias else None
    out = w8a8_linear_cpu(x, w, w_scale, bias)
    assert out is not None, "the compiled CPU kernels did not build"
    assert torch.equal(out, int8_gemm_ref(*per_token_quant_ref(x), w, w_scale, bias))
    # bfloat16 rows give a bfloat16 output (tests/kernels/test_w8a8_bf16.py); a float32 bias
    # with them is left to the eager path
    if bias is not None:
        assert w8a8_linear_cpu(x.to(torch.bfloat16), w, w_scale, bias) is None


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def test_packed_gemm_is_refused_where_it_would_saturate():
    """Full-range activations and weights, the case where oneDNN's non-VNNI int8 kernel
    overflows its int16 pair sums: the pack is either exact or refused (None, then _int_mm)."""
    m, n, k = 8, 32, 576
    a = torch.full((m, k), 127, dtype=torch.int8)
    a[1::2] = -127
    w = _int8((n, k), 3)
    w[: n // 2] = 127
    packed = pack_int8_weight(w)
    ones = torch.ones(m, 1), torch.ones(n)
    want = (a.double() @ w.double().t()).float()
    assert torch.equal(int8_gemm(a, ones[0], w, ones[1], packed=packed), want)
    if packed is not None:
        assert torch.equal(int8_gemm(a, ones[0], w, ones[1]), want)


@pytest.mark.parametrize("rows", [1, 2, 5, 33, 64])
@pytest.mark.parametrize("has_bias", [False, True])
def test_packed_weight_gemm_is_bit_exact(rows, has_bias):
    """oneDNN's int8 matmul on the pre-packed weight (2 rows and more; one row stays on
    _int_mm): the same exact accumulator, then the same epilogue, so equal bit for bit, for an
    int8 input and for the one-call float input."""
    n, k = 70, 100
    gen = torch.Generator().manual_seed(rows)
    a, w = _int8((rows, k), 10), _int8((n, k), 11)
    a[0, :3] = torch.tensor([127, -127, -128 + 1], dtype=torch.int8)  # extremes
    a_scale, w_scale = torch.rand(rows, 1, generator=gen), torch.rand(n, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    packed = pack_int8_weight(w)
    if packed is None:  # exact only with VNNI: AVX2 alone saturates its pair sums (Zen 3)
        assert not _cpu_has_vnni(), "no oneDNN int8 matmul in this torch"
    ref = int8_gemm_ref(a, a_scale, w, w_scale, bias)
    assert torch.equal(int8_gemm(a, a_scale, w, w_scale, bias, packed=packed), ref)
    x = _rows((rows, k), seed=rows)
    assert torch.equal(
        w8a8_linear_cpu(x, w, w_scale, bias, packed),
        int8_gemm_ref(*per_token_quant_ref(x), w, w_scale, bias),
    )


def test_w8a8_linear_repacks_a_changed_weight():
    from torch import nn

    from lmengine.models.w8a8 import W8A8Linear

    layer = W8A8Linear.from_float(nn.Linear(64, 48))
    x = _rows((4, 64), seed=12)

    def reference():
        return int8_gemm_ref(*per_token_quant_ref(x), layer.weight, layer.weight_scale, layer.bias)

    assert torch.equal(layer(x), reference())
    first = layer.packed_weights()  # (oneDNN's layout, the AMX-INT8 blocks)
    amx = pack_int8_weight_amx(layer.weight) is not None
    assert (first[1] is None) == (not amx)
    if not amx:  # None: refused here
        assert (first[0] is None) == (pack_int8_weight(layer.weight) is None)
    assert all(a is b for a, b in zip(layer.packed_weights(), first))  # cached
    with torch.no_grad():
        layer.weight.copy_(-layer.weight)  # in place, as a checkpoint load does
    again = layer.packed_weights()
    assert all(a is not b for a, b in zip(again, first) if a is not None)
    assert torch.equal(layer(x), reference())


@pytest.mark.parametrize("shape", GEMM_SHAPES)
def test_int8_mm_triton_exact(triton_device, shape):
    from lmengine.kernels.triton.w8a8 import int8_mm_triton

    m, n, k = shape
    a, w = _int8((m, k), 4).to(triton_device), _int8((n, k), 5).to(triton_device)
    assert torch.equal(int8_mm_triton(a, w), int8_mm_ref(a, w))


@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_int8_gemm_triton_dequant(triton_device, shape, has_bias):
    from lmengine.kernels.triton.w8a8 import int8_gemm_triton

    m, n, k = shape
    gen = torch.Generator().manual_seed(6)
    a, w = _int8((m, k), 7), _int8((n, k), 8)
    a_scale, w_scale = torch.rand(m, 1, generator=gen), torch.rand(n, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    args = [t.to(triton_device) if t is not None else None for t in (a, a_scale, w, w_scale, bias)]
    out = int8_gemm_triton(*args)
    ref = int8_gemm_ref(a, a_scale, w, w_scale, bias)
    # exact accumulator; the epilogue's float32 multiplies may fuse differently: 1e-6 relative
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)


def test_int8_gemm_checks_inputs():
    a, w = _int8((2, 16), 0), _int8((4, 16), 1)
    with pytest.raises(ValueError, match="int8"):
        int8_gemm(a.float(), torch.ones(2, 1), w, torch.ones(4))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        int8_gemm(a, torch.ones(2, 1), _int8((4, 8), 1), torch.ones(4))
    with pytest.raises(ValueError, match="a_scale"):
        int8_gemm(a, torch.ones(2), w, torch.ones(4))


def test_linear_on_quantized_operands_tracks_float():
    """End to end: quantize x per token and W per channel; the int8 GEMM stays within the
    quantization error of the float product (~1 % relative for Gaussian data)."""
    from lmengine.models.w8a8 import quantize_weight

    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(7, 256, generator=gen), torch.randn(96, 256, generator=gen)
    w_q, w_scale = quantize_weight(w)
    out = int8_gemm(*per_token_quant(x), w_q, w_scale)
    rel = (out - x @ w.t()).norm() / (x @ w.t()).norm()
    assert rel < 0.02


# ---- SwiGLU product + quantization -------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul_compiled_against_reference(rows):
    """silu(gate) * up in one compiled pass: float output within a few ulp of torch's, the
    quantized output within one int8 step; a column-sliced (strided) gate_up works."""
    from lmengine.kernels.activation import silu_mul_compiled, silu_mul_ref
    from lmengine.kernels.w8a8 import silu_mul_quant_cpu

    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * 1536 + 8, generator=gen) * 4.0
    wide[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated exp, both ways
    gate_up = wide[:, 8:]  # rows contiguous, not the whole tensor
    ref = silu_mul_ref(gate_up)
    act = silu_mul_compiled(gate_up)
    assert act is not None, "the compiled CPU kernels did not build"
    torch.testing.assert_close(act, ref, rtol=1e-6, atol=1e-6)
    q, scale = silu_mul_quant_cpu(gate_up)
    q_ref, scale_ref = per_token_quant_ref(ref)
    _assert_norm_quant_close(q, scale, q_ref, scale_ref, rtol=1e-6)
