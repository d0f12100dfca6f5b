"""Learned attention sinks (gpt-oss) in the paged-attention reference and the compiled CPU
kernels, against the independent dense float64 reference. A sink is one more logit per query
head in the softmax, with no value; it is not soft-capped and no window hides it."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_features
from lmengine.kernels.kv_quant import quantize_kv_ref
from lmengine.kernels.paged_attention import paged_attention_ref
from tests.kernels.helpers import dense_causal_attention, make_paged_batch

CASES = {
    # name: (q_lens, kv_lens)
    "decode": ([1, 1, 1, 1], [1, 5, 17, 32]),
    "fresh": ([9, 20], [9, 20]),
    "mixed": ([5, 1, 16, 1, 7], [5, 9, 40, 1, 7]),
    "chunked": ([3, 12], [20, 12]),
    "long": ([70, 1], [130, 77]),
}
# (sliding_window, softcap); a window of 1 or 2 leaves a query one or two keys
VARIANTS = [(None, None), (4, None), (1, None), (2, None), (None, 5.0), (6, 2.0)]
SCALE = 0.25


def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    """[num_heads] float32: a spread of sinks, one that dominates every score and one that
    vanishes next to them."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 40.0, -40.0
    return sinks


def _batch(case, block_size, heads=(8, 2), head_dim=16, dtype=torch.float32, seed=0):
    q_lens, kv_lens = CASES[case]
    q, kc, vc, meta, dk, dv = make_paged_batch(
        q_lens, kv_lens, *heads, head_dim, block_size, dtype=dtype, seed=seed
    )
    return q_lens, kv_lens, q * 4, kc, vc, meta, dk, dv  # large scores: the cap bites


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_ref_matches_dense(case, window, softcap):
    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch(case, 4)
    sinks = _sinks(8)
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, SCALE, window, softcap, sinks)
    ref = paged_attention_ref(q, kc, vc, meta, SCALE, window, softcap, sinks=sinks)
    torch.testing.assert_close(ref, expected.float(), rtol=1e-5, atol=1e-5)


# -- the compiled kernels, called directly -----------------------------------------------------


@pytest.mark.parametrize("kv_lens", [[1], [5, 17, 32], [16, 1, 47, 64, 3]])
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 16), ((9, 3), 64), ((8, 1), 128)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (2, 0.0), (7, 1.5)])
def test_decode_kernel(ext, threads, kv_lens, heads, head_dim, window, softcap):
    q_lens = [1] * len(kv_lens)
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, *heads, head_dim, 4, seed=3)
    sinks = _sinks(heads[0])
    scale = head_dim**-0.5
    expected = dense_causal_attention(
        q, dk, dv, q_lens, kv_lens, scale, window or None, softcap or None, sinks
    ).float()
    tables = meta.block_tables.contiguous()
    args = (tables, meta.kv_lens, scale, window, softcap)
    out = ext.paged_decode_attention(q, kc, vc, *args, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out = ext.paged_decode_attention_bf16(q, kc.bfloat16(), vc.bfloat16(), *args, sinks=sinks)
    kb, vb = [k.bfloat16() for k in dk], [v.bfloat16() for v in dv]
    bf16_expected = dense_causal_attention(
        q, kb, vb, q_lens, kv_lens, scale, window or None, softcap or None, sinks
    )
    torch.testing.assert_close(out.double(), bf16_expected, rtol=1e-5, atol=1e-5)
    kq, ks = quantize_kv_ref(kc)
    vq, vs = quantize_kv_ref(vc)
    out = ext.paged_decode_attention_int8(q, kq, vq, ks, vs, *args, sinks=sinks)
    ref = paged_attention_ref(
        q, kq, vq, meta, scale, window or None, softcap or None, ks, vs, sinks=sinks
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_kernel_rejects_bad_sinks(ext):
    q, kc, vc, meta, *_ = make_paged_batch([1], [5], 4, 2, 16, 4)
    args = (meta.block_tables.contiguous(), meta.kv_lens, 1.0, 0, 0.0)
    for bad in (torch.zeros(3), torch.zeros(4).double(), torch.zeros(8)[::2]):
        with pytest.raises(RuntimeError, match="sinks must be"):
            ext.paged_decode_attention(q, kc, vc, *args, sinks=bad)


@pytest.fixture
def prefill_ext(ext):
    if not ext.prefill_attention_available():
        pytest.skip("not offered here: a torch without oneDNN, or a build without AVX-512")
    return ext


@pytest.mark.parametrize(
    "q_lens,kv_lens", [([5], [5]), ([100, 37], [100, 37]), ([30, 64, 1], [200, 64, 17])]
)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 1), 32), ((4, 4), 16)])
def test_prefill_kernel(prefill_ext, threads, q_lens, kv_lens, heads, head_dim):
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, *heads, head_dim, 16, seed=5)
    sinks = _sinks(heads[0])
    scale = head_dim**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale, sinks=sinks)
    args = (meta.block_tables.contiguous(), meta.q_start_loc, meta.q_lens, meta.kv_lens, scale)
    out = torch.full_like(q, float("nan"))
    prefill_ext.paged_prefill_attention(q, kc, vc, *args, out, sinks)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)
    if cpu_features.has_bf16_units():
        qb, kb, vb = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
        out = torch.full_like(qb, float("nan"))
        prefill_ext.paged_prefill_attention_bf16(qb, kb, vb, *args, out, sinks)
        kbs, vbs = [k.bfloat16() for k in dk], [v.bfloat16() for v in dv]
        expected = dense_causal_attention(qb, kbs, vbs, q_lens, kv_lens, scale, sinks=sinks)
        torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2e-2)
