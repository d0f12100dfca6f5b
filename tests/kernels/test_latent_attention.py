"""Attention over a latent cache (DeepSeek's multi-head latent attention, absorbed form): many
query heads over one KV head whose keys are [latent | rope] and whose values are the latent
part, passed as the non-contiguous view v_cache = k_cache[..., :v_head_dim]. The reference and
the compiled kernels against the dense float64 reference, at DeepSeek's 576 / 512 and at small
head dims."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_features
from lmengine.kernels.kv_quant import quantize_kv_ref
from lmengine.kernels.paged_attention import paged_attention_ref
from tests.kernels.helpers import dense_causal_attention, make_latent_batch

CASES = {
    # name: (q_lens, kv_lens)
    "decode": ([1, 1, 1], [1, 17, 40]),
    "fresh": ([9, 20], [9, 20]),
    "chunked": ([3, 12], [20, 30]),  # prompt chunks over cached history (q_len < kv_len)
    "mixed": ([5, 1, 16, 1], [5, 9, 40, 1]),
}
# (num_heads, head_dim, v_head_dim): small heads, and DeepSeek's kv_lora_rank 512 + rope 64
SHAPES = [(8, 24, 16), (16, 24, 16), (16, 576, 512)]
BF16 = torch.bfloat16


def _sinks(num_heads: int) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(9)) * 2


def _expected(q, dk, dv, case, scale, window=None, softcap=None, sinks=None):
    q_lens, kv_lens = CASES[case]
    return dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale, window, softcap, sinks)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_sinks", [False, True])
def test_ref_matches_dense(case, shape, with_sinks):
    num_heads, head_dim, v_head_dim = shape
    q, kc, vc, meta, dk, dv = make_latent_batch(*CASES[case], num_heads, head_dim, v_head_dim, 4)
    sinks = _sinks(num_heads) if with_sinks else None
    expected = _expected(q, dk, dv, case, 0.1, sinks=sinks).float()
    ref = paged_attention_ref(q, kc, vc, meta, 0.1, sinks=sinks)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)


# -- the compiled kernels, called directly -----------------------------------------------------


@pytest.mark.parametrize("kv_lens", [[1], [5, 17, 32], [16, 1, 47, 64, 3]])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_kernel(ext, threads, kv_lens, shape):
    num_heads, head_dim, v_head_dim = shape
    q_lens = [1] * len(kv_lens)
    q, kc, vc, meta, dk, dv = make_latent_batch(q_lens, kv_lens, num_heads, head_dim, v_head_dim, 4)
    scale = head_dim**-0.5
    sinks = _sinks(num_heads)
    tables = meta.block_tables.contiguous()
    for s in (None, sinks):
        expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale, sinks=s)
        out = ext.paged_decode_attention(q, kc, vc, tables, meta.kv_lens, scale, sinks=s)
        assert out.shape == (len(kv_lens), num_heads, v_head_dim)
        torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
        kb = kc.to(BF16)
        out = ext.paged_decode_attention_bf16(
            q, kb, kb[..., :v_head_dim], tables, meta.kv_lens, scale, sinks=s
        )
        kbs = [k.to(BF16) for k in dk]
        expected = dense_causal_attention(
            q, kbs, [k[..., :v_head_dim] for k in kbs], q_lens, kv_lens, scale, sinks=s
        )
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_decode_kernel_with_one_tensor_for_both(ext):
    """The same tensor as keys and values: the bfloat16 kernel converts its rows once, the int8
    kernel still applies each side's own scales."""
    q, kc, _, meta, _, _ = make_latent_batch([1, 1], [9, 30], 8, 32, 32, 4, seed=7)
    args = (meta.block_tables.contiguous(), meta.kv_lens, 0.2)
    kb = kc.to(BF16)
    out = ext.paged_decode_attention_bf16(q, kb, kb, *args)
    torch.testing.assert_close(out, paged_attention_ref(q, kb, kb, meta, 0.2).float())
    kq, ks = quantize_kv_ref(kc)
    vs = ks * torch.rand(ks.shape)  # the values' own scales
    out = ext.paged_decode_attention_int8(q, kq, kq, ks, vs, *args)
    ref = paged_attention_ref(q, kq, kq, meta, 0.2, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_kernel_rejects_other_layouts(ext):
    q, kc, vc, meta, *_ = make_latent_batch([1], [5], 4, 24, 16, 4)
    args = (meta.block_tables.contiguous(), meta.kv_lens, 1.0)
    with pytest.raises(RuntimeError, match="values no wider than keys"):
        ext.paged_decode_attention(q[..., :16].contiguous(), vc.contiguous(), kc, *args)
    strided = torch.randn(kc.shape[0], 2, *kc.shape[1:]).transpose(0, 1)[0]  # blocks apart
    with pytest.raises(RuntimeError, match="first D elements of a contiguous cache's rows"):
        ext.paged_decode_attention(q, kc, strided[..., :16], *args)
    kq, ks = quantize_kv_ref(kc)
    with pytest.raises(RuntimeError, match="int8 cache needs values as wide as keys"):
        ext.paged_decode_attention_int8(q, kq, kq[..., :16].contiguous(), ks, ks, *args)


@pytest.fixture
def prefill_ext(ext):
    if not ext.prefill_attention_available():
        pytest.skip("not offered here: a torch without oneDNN, or a build without AVX-512")
    return ext


@pytest.mark.parametrize(
    "q_lens,kv_lens", [([5], [5]), ([100, 37], [100, 37]), ([30, 64, 1], [200, 64, 17])]
)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prefill_kernel(prefill_ext, threads, q_lens, kv_lens, shape):
    num_heads, head_dim, v_head_dim = shape
    q, kc, vc, meta, dk, dv = make_latent_batch(
        q_lens, kv_lens, num_heads, head_dim, v_head_dim, 16, seed=5
    )
    scale = head_dim**-0.5
    sinks = _sinks(num_heads)
    args = (meta.block_tables.contiguous(), meta.q_start_loc, meta.q_lens, meta.kv_lens, scale)
    for s in (None, sinks):
        expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale, sinks=s)
        out = torch.full((q.shape[0], num_heads, v_head_dim), float("nan"))
        prefill_ext.paged_prefill_attention(q, kc, vc, *args, out, s)
        torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
        if not cpu_features.has_bf16_units():
            continue
        qb, kb = q.to(BF16), kc.to(BF16)
        out = torch.full((q.shape[0], num_heads, v_head_dim), float("nan"), dtype=BF16)
        prefill_ext.paged_prefill_attention_bf16(qb, kb, kb[..., :v_head_dim], *args, out, s)
        kbs = [k.to(BF16) for k in dk]
        expected = dense_causal_attention(
            qb, kbs, [k[..., :v_head_dim] for k in kbs], q_lens, kv_lens, scale, sinks=s
        )
        torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2e-2)
