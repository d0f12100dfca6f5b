"""Rotary embedding: CPU dispatch vs reference vs transformers' apply_rotary_pos_emb, and the
Triton launcher."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lmengine.kernels import apply_rotary
from lmengine.kernels.rotary import apply_rotary_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_tokens, num_heads, num_kv_heads, head_dim): one token, GQA 8/2 and 6/1, MHA 4/4,
# a head_dim whose half (12) is not a power of two
SHAPES = [(1, 4, 4, 16), (7, 8, 2, 64), (5, 6, 1, 32), (3, 4, 2, 24)]
# Triton computes each output in float32 and rounds once; the reference rounds q*cos, rot*sin
# and their sum separately in the input dtype, so half-precision results differ by a few ulps
# where the two products nearly cancel. The interpreter also truncates float32 -> bfloat16.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 4e-3, "atol": 4e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
}


def _cos_sin(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """cos, sin: [num_tokens, head_dim] with equal halves, as Llama's rotary module returns."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _inputs(shape, dtype, seed, max_position=4096):
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    positions[0] = max_position - 1  # the largest position, the hardest angles
    cos, sin = _cos_sin(positions, head_dim)
    return q, k, cos.to(dtype), sin.to(dtype)


# --- CPU dispatch path -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_rotary_cpu_matches_reference_and_transformers(dtype, shape, seed):
    q, k, cos, sin = _inputs(shape, dtype, seed)
    q_out, k_out = apply_rotary(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    # transformers works on [batch, heads, seq, dim]; with [tokens, heads, dim] and cos
    # [tokens, dim], unsqueeze_dim=1 broadcasts cos over the heads the same way
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(q_out, q_hf, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_hf, rtol=0, atol=0)


def test_rotary_cpu_matches_complex_rotation():
    """Independent formula: the NeoX pair (x_i, x_{i + d/2}) is the complex number
    x_i + j*x_{i + d/2}, multiplied by cos_i + j*sin_i."""
    q, k, cos, sin = _inputs((6, 4, 2, 32), torch.float64, seed=4)
    q_out, _ = apply_rotary(q, k, cos, sin)
    half = q.shape[-1] // 2
    z = torch.complex(q[..., :half], q[..., half:])
    rotated = z * torch.complex(cos[:, None, :half], sin[:, None, :half])
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    torch.testing.assert_close(q_out, expected, rtol=1e-12, atol=1e-12)


def test_rotary_cpu_rejects_mismatched_cos():
    q, k, cos, sin = _inputs((3, 4, 2, 16), torch.float32, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        apply_rotary(q, k, cos[:2], sin[:2])


# --- Triton launcher ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rotary_triton_matches_reference(triton_device, dtype, shape):
    from lmengine.kernels.triton.rotary import apply_rotary_triton

    q, k, cos, sin = _inputs(shape, dtype, seed=shape[0])
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    dev = triton_device
    q_out, k_out = apply_rotary_triton(q.to(dev), k.to(dev), cos.to(dev), sin.to(dev))
    assert q_out.dtype == dtype and k_out.dtype == dtype
    torch.testing.assert_close(q_out.cpu(), q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out.cpu(), k_ref, **TOL[dtype])


def test_rotary_triton_strided_qkv_split_and_float32_tables(triton_device):
    """q and k as views into a fused qkv projection; float32 cos/sin promote like the reference."""
    from lmengine.kernels.triton.rotary import apply_rotary_triton

    num_tokens, num_heads, num_kv_heads, head_dim = 5, 8, 2, 32
    q, k, cos, sin = _inputs((num_tokens, num_heads, num_kv_heads, head_dim), torch.float16, 7)
    cos, sin = cos.float(), sin.float()
    qkv = torch.cat(
        (q.flatten(1), k.flatten(1), torch.zeros(num_tokens, num_kv_heads * head_dim)), dim=1
    ).to(torch.float16)
    qkv = qkv.to(triton_device)
    q_view = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_view = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k_view = k_view.view(num_tokens, num_kv_heads, head_dim)
    assert not q_view.is_contiguous()
    q_out, k_out = apply_rotary_triton(q_view, k_view, cos.to(triton_device), sin.to(triton_device))
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    assert q_out.dtype == q_ref.dtype == torch.float32
    torch.testing.assert_close(q_out.cpu(), q_ref, **TOL[torch.float32])
    torch.testing.assert_close(k_out.cpu(), k_ref, **TOL[torch.float32])
    assert torch.equal(qkv[:, : num_heads * head_dim].cpu(), q.flatten(1))  # inputs untouched


def test_rotary_triton_rejects_bad_inputs(triton_device):
    from lmengine.kernels.triton.rotary import apply_rotary_triton

    q, k, cos, sin = (t.to(triton_device) for t in _inputs((3, 4, 2, 16), torch.float32, 0))
    with pytest.raises(ValueError, match="even"):
        apply_rotary_triton(q[..., :15], k[..., :15], cos[:, :15], sin[:, :15])
    with pytest.raises(ValueError, match="cos must be"):
        apply_rotary_triton(q, k, cos[:2], sin)
    with pytest.raises(ValueError, match="does not match q"):
        apply_rotary_triton(q, k[:2], cos, sin)
    with pytest.raises(ValueError, match="dtypes differ"):
        apply_rotary_triton(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        apply_rotary_triton(q.double(), k.double(), cos, sin)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        apply_rotary_triton(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin)
    with pytest.raises(ValueError, match=r"\[num_tokens, heads, head_dim\]"):
        apply_rotary_triton(q.flatten(1), k, cos, sin)
