"""The Triton RMSNorm, rotary, multi-LoRA, W8A8 and mixture-of-experts kernels against their
PyTorch references at real sizes: SmolLM2's and Llama-7B's widths (576 to 14,336), prefill
batches of thousands of tokens, positions up to 32k, adapters of rank 8 to 64 over 4,096-wide
linears, int8 GEMMs of Llama-7B's projections and MoE layers of Qwen-MoE's and Mixtral's
shapes. Input builders and tolerances come from tests/kernels; references run on the CPU
(MoE's dense reference on the device, in token chunks)."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from lmengine.kernels.lora import LoRAMeta, lora_add_ref
from lmengine.kernels.moe import fused_moe_ref
from lmengine.kernels.rms_norm import add_rms_norm_ref, rms_norm_ref
from lmengine.kernels.rotary import apply_rotary_ref
from lmengine.kernels.w8a8 import (
    dequant_ref,
    int8_mm_ref,
    per_token_quant_ref,
    rms_norm_quant_ref,
)
from tests.gpu.common import ON_CPU, by_mode
from tests.kernels.test_lora import _assert_close_to_scale, _pool
from tests.kernels.test_moe import _inputs as moe_inputs
from tests.kernels.test_rms_norm import EPS
from tests.kernels.test_rms_norm import TOL as NORM_TOL
from tests.kernels.test_rms_norm import _inputs as norm_inputs
from tests.kernels.test_rotary import TOL as ROTARY_TOL
from tests.kernels.test_rotary import _inputs as rotary_inputs
from tests.kernels.test_w8a8 import _assert_norm_quant_close, _int8, _norm_inputs, _rows

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# ---- RMSNorm ------------------------------------------------------------------------------------

# (num_rows, hidden): a SmolLM2 decode row and prefill batch, Llama-7B's and -70B's widths,
# and a row wider than MAX_BLOCK (8,192) with a ragged second pass
NORM_SHAPES = by_mode(
    gpu=[(1, 576), (4096, 576), (2048, 4096), (64, 8192), (16, 12288)],
    cpu=[(1, 576), (37, 576), (3, 8200)],
)


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(device, shape, dtype):
    from lmengine.kernels.triton.rms_norm import add_rms_norm_triton, rms_norm_triton

    x, residual, weight = norm_inputs(shape, dtype, seed=shape[1])
    out = rms_norm_triton(x.to(device), weight.to(device), EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.cpu(), rms_norm_ref(x, weight, EPS), **NORM_TOL[dtype])
    normed, summed = add_rms_norm_triton(x.to(device), residual.to(device), weight.to(device), EPS)
    ref_normed, ref_summed = add_rms_norm_ref(x, residual, weight, EPS)
    if ON_CPU and dtype == torch.bfloat16:
        # the interpreter truncates float32 -> bfloat16 (tests/kernels/test_rms_norm.py)
        torch.testing.assert_close(summed.cpu(), ref_summed, rtol=8e-3, atol=1e-5)
    else:
        assert torch.equal(summed.cpu(), ref_summed)  # one add per element, as torch
    torch.testing.assert_close(normed.cpu(), ref_normed, **NORM_TOL[dtype])


# ---- rotary -------------------------------------------------------------------------------------

# (num_tokens, num_heads, num_kv_heads, head_dim)
ROTARY_SHAPES = by_mode(
    gpu=[(1, 32, 32, 128), (4096, 9, 3, 64), (8192, 32, 8, 128), (333, 8, 4, 256)],
    cpu=[(1, 9, 3, 64), (37, 8, 2, 128)],
)


@pytest.mark.parametrize("shape", ROTARY_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(device, shape, dtype):
    from lmengine.kernels.triton.rotary import apply_rotary_triton

    q, k, cos, sin = rotary_inputs(shape, dtype, seed=shape[0], max_position=32768)
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    q_out, k_out = apply_rotary_triton(*(t.to(device) for t in (q, k, cos, sin)))
    assert q_out.dtype == dtype and k_out.dtype == dtype
    torch.testing.assert_close(q_out.cpu(), q_ref, **ROTARY_TOL[dtype])
    torch.testing.assert_close(k_out.cpu(), k_ref, **ROTARY_TOL[dtype])


# ---- multi-LoRA ---------------------------------------------------------------------------------

RANKS = (8, 16, 64, 32)  # four adapters in one pool


def _lora_layout(kind: str) -> list[int]:
    """token -> adapter (-1: base model): a decode batch (one token per sequence, adapters
    interleaved) or a prefill batch (long runs of one adapter between base tokens)."""
    rng = random.Random(kind)
    if kind == "decode":
        return [rng.choice([-1, 0, 1, 2, 3]) for _ in range(by_mode(64, 12))]
    runs = by_mode(
        gpu=[(0, 300), (-1, 3), (2, 400), (1, 1), (-1, 40), (3, 200)],
        cpu=[(0, 9), (-1, 2), (2, 17), (3, 5)],
    )
    return [adapter for adapter, n in runs for _ in range(n)]


# (in_features, out_features): Llama-7B's q_proj and its fused gate_up, SmolLM2's qkv
LORA_SHAPES = by_mode(gpu=[(4096, 4096), (4096, 22016), (576, 960)], cpu=[(576, 960), (96, 40)])
# relative to the largest LoRA delta (with 4,096 inputs and rank 64 it reaches ~2,600): float32 sums
# in another order; float16 / bfloat16 round the delta and the sum once instead of twice
LORA_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("layout", ["decode", "prefill"])
@pytest.mark.parametrize("shape", LORA_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora(device, layout, shape, dtype):
    from lmengine.kernels.triton.lora import lora_add_triton

    in_f, out_f = shape
    token_adapter = torch.tensor(_lora_layout(layout))
    lora_a, lora_b, scale, table = _pool(RANKS, in_f, out_f, seed=4, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(token_adapter), in_f, generator=gen).to(dtype)
    base = torch.randn(len(token_adapter), out_f, generator=gen).to(dtype)
    expected = lora_add_ref(base.clone(), x, lora_a, lora_b, scale, table, token_adapter)
    meta = LoRAMeta.build(token_adapter).to(device)
    out = base.clone().to(device)  # NOTE: a copy on the CPU too, base must stay as it was
    dev = [t.to(device) for t in (x, lora_a, lora_b, scale, table)]
    lora_add_triton(out, *dev, meta)
    out = out.cpu()
    _assert_close_to_scale(out.float(), expected.float(), base.float(), LORA_TOL[dtype])
    none = token_adapter < 0
    assert torch.equal(out[none], base[none])  # base-model tokens untouched
    assert not torch.allclose(out[~none].float(), base[~none].float())


# ---- W8A8 ---------------------------------------------------------------------------------------

# rows quantized per token: a decode row, a prefill batch of Llama-7B's hidden width, SmolLM2's
# MLP input and Llama-7B's down_proj input (11,008 wide)
QUANT_SHAPES = by_mode(
    gpu=[(1, 4096), (8192, 4096), (333, 1536), (64, 11008)],
    cpu=[(1, 576), (37, 1536), (2, 8200)],
)


@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_quant(device, shape, dtype):
    from lmengine.kernels.triton.w8a8 import per_token_quant_triton

    x = _rows(shape, dtype, seed=shape[0])
    q, scale = per_token_quant_triton(x.to(device))
    q_ref, scale_ref = per_token_quant_ref(x)
    # same float32 operations in the same order (a max is order-free): bit-exact
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


NORM_QUANT_SHAPES = by_mode(gpu=[(1, 576), (2048, 4096), (64, 8192)], cpu=[(1, 576), (37, 576)])


@pytest.mark.parametrize("shape", NORM_QUANT_SHAPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_quant(device, shape, with_residual, dtype):
    from lmengine.kernels.triton.w8a8 import rms_norm_quant_triton

    x, residual, weight = _norm_inputs(shape, dtype, seed=shape[0])
    res = residual if with_residual else None
    dev_res = residual.to(device) if with_residual else None
    q, scale, summed = rms_norm_quant_triton(x.to(device), weight.to(device), EPS, dev_res)
    q_ref, scale_ref, summed_ref = rms_norm_quant_ref(x, weight, EPS, res)
    # tolerances as tests/kernels/test_w8a8.py: one int8 step on a rounding boundary
    _assert_norm_quant_close(
        q.cpu(), scale.cpu(), q_ref, scale_ref, 1e-5 if dtype == torch.float32 else 1e-3
    )
    assert (summed is None) == (not with_residual)
    if with_residual:
        assert torch.equal(summed.cpu(), summed_ref)


# (M, N, K): a decode row through Llama-7B's gate_up, a batch through q_proj, a prefill batch
# through down_proj (K = 11,008: accumulators up to 1.8e8 stay exact in int32)
GEMM_SHAPES = by_mode(
    gpu=[(1, 22016, 4096), (77, 4096, 4096), (300, 4096, 11008)],
    cpu=[(1, 192, 96), (37, 130, 200)],
)


@functools.lru_cache(maxsize=len(GEMM_SHAPES))
def _gemm_operands(shape: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    """a [M, K] and w [N, K] int8, and their exact accumulator [M, N] int32 (int8_mm_ref
    multiplies in int64 on the CPU: seconds at these sizes, so once per shape)."""
    m, n, k = shape
    a, w = _int8((m, k), seed=m), _int8((n, k), seed=n)
    return a, w, int8_mm_ref(a, w)


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=str)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm(device, shape, has_bias, out_dtype):
    from lmengine.kernels.triton.w8a8 import int8_gemm_triton, int8_mm_triton

    m, n, k = shape
    a, w, acc = _gemm_operands(shape)
    gen = torch.Generator().manual_seed(k)
    a_scale, w_scale = torch.rand(m, 1, generator=gen), torch.rand(n, generator=gen) / 100
    bias = torch.randn(n, generator=gen) if has_bias else None
    a_dev, w_dev = a.to(device), w.to(device)
    assert torch.equal(int8_mm_triton(a_dev, w_dev).cpu(), acc)  # exact
    dev = [t.to(device) if t is not None else None for t in (a_scale, w_scale, bias)]
    out = int8_gemm_triton(a_dev, dev[0], w_dev, dev[1], dev[2], out_dtype)
    expected = dequant_ref(acc, a_scale, w_scale, bias, out_dtype)  # int8_gemm_ref's epilogue
    assert out.dtype == out_dtype
    # the epilogue's float32 multiplies may fuse differently: 1e-6 relative (float32), then
    # one bfloat16 rounding step
    tol = 1e-6 if out_dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.cpu(), expected, rtol=tol, atol=tol)


# ---- mixture of experts -------------------------------------------------------------------------

# name: (num_tokens, num_experts, top_k, hidden, inter)
MOE_SHAPES = by_mode(
    gpu={
        "decode": (1, 16, 4, 2048, 1408),  # Qwen-MoE's expert shape
        "prefill": (512, 16, 4, 2048, 1408),  # ~128 slots per expert: several row tiles
        "mixtral_width": (48, 2, 2, 4096, 14336),  # Mixtral's expert shape
    },
    cpu={"decode": (1, 8, 2, 64, 96), "prefill": (40, 8, 2, 96, 80)},
)
MOE_REF_BYTES = 1 << 29  # the dense reference gathers each slot's weights: chunk the tokens


def _moe_reference(x, w_gate_up, w_down, weights, ids, act=F.silu, **biases) -> torch.Tensor:
    per_token = w_gate_up[0].numel() * x.element_size()
    chunk = max(1, MOE_REF_BYTES // per_token)
    parts = [
        fused_moe_ref(
            x[i : i + chunk],
            w_gate_up,
            w_down,
            weights[i : i + chunk],
            ids[i : i + chunk],
            act,
            **biases,
        )
        for i in range(0, x.shape[0], chunk)
    ]
    return torch.cat(parts)


@pytest.mark.parametrize("name", list(MOE_SHAPES))
@pytest.mark.parametrize("dtype", by_mode(gpu=[torch.float32, torch.bfloat16], cpu=[torch.float32]))
def test_fused_moe(device, name, dtype):
    from lmengine.kernels.triton.moe import fused_moe_triton

    args = [t.to(device) for t in moe_inputs(*MOE_SHAPES[name], seed=1)]
    x, w_gate_up, w_down = (t.to(dtype) for t in args[:3])
    weights, ids = args[3:]
    got = fused_moe_triton(x, w_gate_up, w_down, weights, ids, F.silu)
    assert got.dtype == dtype and got.shape == x.shape
    # the float32 reference on the same (rounded) inputs; bfloat16 rounds the gate/up
    # outputs and the expert outputs to bfloat16 on the way: 2 % of the output's scale
    expected = _moe_reference(x.float(), w_gate_up.float(), w_down.float(), weights, ids)
    tol = 5e-5 if dtype == torch.float32 else 2e-2 * float(expected.abs().max())
    torch.testing.assert_close(got.float().cpu(), expected.cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(MOE_SHAPES))
@pytest.mark.parametrize("dtype", by_mode(gpu=[torch.float32, torch.bfloat16], cpu=[torch.float32]))
def test_fused_moe_biased_clamped_swiglu(device, name, dtype):
    """gpt-oss's experts: per-expert biases added in the kernel's epilogue, ClampedSwiGLU
    (a GatedActivation, called with gate and up) between the two GEMMs."""
    from lmengine.kernels.activation import ClampedSwiGLU
    from lmengine.kernels.triton.moe import fused_moe_triton

    args = moe_inputs(*MOE_SHAPES[name], seed=2)
    num_experts, two_inter, hidden = args[1].shape
    gen = torch.Generator().manual_seed(3)
    biases = {
        "b_gate_up": torch.randn(num_experts, two_inter, generator=gen),
        "b_down": torch.randn(num_experts, hidden, generator=gen),
    }
    act = ClampedSwiGLU(alpha=1.702, limit=1.5)  # a low limit: the clamps bite
    x, w_gate_up, w_down = (t.to(device, dtype) for t in args[:3])
    weights, ids = (t.to(device) for t in args[3:])
    on_dev = {k: v.to(device, dtype) for k, v in biases.items()}
    got = fused_moe_triton(x, w_gate_up, w_down, weights, ids, act, **on_dev)
    assert got.dtype == dtype and got.shape == x.shape
    rounded = {k: v.to(dtype).float() for k, v in biases.items()}
    expected = _moe_reference(
        x.float(), w_gate_up.float(), w_down.float(), weights, ids, act, **rounded
    )
    tol = 5e-5 if dtype == torch.float32 else 2e-2 * float(expected.abs().max())
    torch.testing.assert_close(got.float().cpu(), expected.cpu(), rtol=tol, atol=tol)
