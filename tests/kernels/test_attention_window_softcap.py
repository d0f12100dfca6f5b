"""Sliding-window attention and logit soft-capping (Mistral, Gemma 2) in the paged kernels:
the CPU path, the reference and the Triton kernel against an independent dense float64
reference. Windows are shorter than the sequences so that they cut keys away."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.helpers import dense_causal_attention, make_paged_batch

CASES = {
    # name: (q_lens, kv_lens)
    "decode": ([1, 1, 1], [5, 17, 32]),
    "fresh": ([9, 20], [9, 20]),
    "mixed": ([5, 1, 16, 1, 7], [5, 9, 40, 1, 7]),
    "chunked": ([3, 12], [20, 12]),
    "long": ([70, 1], [130, 77]),
}
# (sliding_window, softcap)
VARIANTS = [(4, None), (1, None), (None, 5.0), (6, 2.0)]


def _batch(case, block_size, seed=0, heads=(8, 2), head_dim=16):
    q_lens, kv_lens = CASES[case]
    return (
        q_lens,
        kv_lens,
        *make_paged_batch(q_lens, kv_lens, *heads, head_dim, block_size, seed=seed),
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_cpu_and_ref_match_dense(case, block_size, window, softcap):
    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch(case, block_size)
    # large scores so that the cap bites (tanh far from linear)
    q = q * 4
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, 0.25, window, softcap).float()
    ref = paged_attention_ref(q, kc, vc, meta, 0.25, window, softcap)
    fast = paged_attention(q, kc, vc, meta, 0.25, window, softcap)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
    plain = dense_causal_attention(q, dk, dv, q_lens, kv_lens, 0.25).float()
    assert not torch.allclose(fast, plain, atol=1e-3), "the variant did not change anything"


def test_window_and_plain_share_one_metadata():
    """Alternating layers (Gemma 2) run both kinds of attention on the same step metadata."""
    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch("mixed", 4, seed=3)
    for window in (None, 3, None, 3):
        got = paged_attention(q, kc, vc, meta, 0.25, window)
        expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, 0.25, window).float()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rejects_bad_window_and_cap():
    _, _, q, kc, vc, meta, _, _ = _batch("decode", 4)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, kc, vc, meta, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(q, kc, vc, meta, 1.0, softcap=-1.0)


def _meta_to(meta, device):
    for name in ("block_tables", "q_start_loc", "q_lens", "kv_lens"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_triton_matches_dense(triton_device, case, window, softcap):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch(case, 4, seed=1, heads=(6, 2))
    q = q * 4
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, 0.25, window, softcap)
    meta = _meta_to(meta, triton_device)
    out = paged_attention_triton(
        q.to(triton_device), kc.to(triton_device), vc.to(triton_device), meta, 0.25, window, softcap
    )
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)
