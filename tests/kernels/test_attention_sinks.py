"""Learned attention sinks (gpt-oss) in every paged-attention path: the reference, the CPU
path (compiled decode and prefill kernels, and the gather + SDPA fallback), the compiled kernels
called directly, the int8 cache and the Triton kernel, against the independent dense float64
reference. A sink is one more logit per query head in the softmax, with no value; it is not
soft-capped and no window hides it."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_features
from lmengine.kernels.kv_quant import quantize_kv_ref
from lmengine.kernels.paged_attention import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_ref,
)
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
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_cpu_and_ref_match_dense(cpu_path, case, block_size, window, softcap):
    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch(case, block_size)
    sinks = _sinks(8)
    expected = dense_causal_attention(
        q, dk, dv, q_lens, kv_lens, SCALE, window, softcap, sinks
    ).float()
    ref = paged_attention_ref(q, kc, vc, meta, SCALE, window, softcap, sinks=sinks)
    fast = paged_attention(q, kc, vc, meta, SCALE, window, softcap, sinks=sinks)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
    plain = dense_causal_attention(q, dk, dv, q_lens, kv_lens, SCALE, window, softcap).float()
    assert not torch.allclose(fast, plain, atol=1e-3), "the sinks did not change anything"
    # the dominating sink leaves its head almost nothing; the vanishing one changes nothing
    assert float(fast[:, 0].abs().max()) < 1e-2
    torch.testing.assert_close(fast[:, -1], plain[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["decode", "mixed", "long"])
def test_sinks_none_is_unchanged(cpu_path, case):
    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch(case, 4, seed=2)
    for window, softcap in [(None, None), (3, None), (None, 4.0)]:
        before = paged_attention(q, kc, vc, meta, SCALE, window, softcap)
        after = paged_attention(q, kc, vc, meta, SCALE, window, softcap, sinks=None)
        assert torch.equal(before, after)
        expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, SCALE, window, softcap)
        torch.testing.assert_close(after, expected.float(), rtol=1e-5, atol=1e-5)
    # a sink of -inf is no sink
    no_sink = torch.full((8,), float("-inf"))
    torch.testing.assert_close(
        paged_attention(q, kc, vc, meta, SCALE, sinks=no_sink),
        paged_attention(q, kc, vc, meta, SCALE),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("heads,head_dim", [((8, 2), 16), ((9, 3), 64), ((4, 1), 128)])
def test_gqa_and_head_dims(cpu_path, heads, head_dim):
    q_lens, kv_lens = [1, 30, 1, 7], [40, 90, 3, 7]
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, *heads, head_dim, 16, seed=4)
    sinks = _sinks(heads[0], seed=1)
    scale = head_dim**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale, sinks=sinks)
    out = paged_attention(q, kc, vc, meta, scale, sinks=sinks)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


def test_bfloat16_sinks_are_used_as_float32():
    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch("mixed", 4)
    sinks = _sinks(8).bfloat16()
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, SCALE, sinks=sinks.float())
    out = paged_attention(q, kc, vc, meta, SCALE, sinks=sinks)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


def test_rejects_bad_sinks():
    _, _, q, kc, vc, meta, _, _ = _batch("decode", 4)
    with pytest.raises(ValueError, match="sinks must be one float logit per query head"):
        paged_attention(q, kc, vc, meta, SCALE, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks must be one float logit per query head"):
        paged_attention(q, kc, vc, meta, SCALE, sinks=torch.zeros(8, dtype=torch.int32))


# -- the compiled kernels, called directly and through the CPU path ----------------------------


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_passes_sinks_to_the_compiled_kernels(ext, monkeypatch, dtype):
    """Decodes go to the compiled decode kernel and prompt chunks (no window, no cap) to the
    compiled prefill kernel, sinks and all; with a window the chunks take the SDPA path."""
    q_lens, kv_lens = [1, 40, 1, 7], [30, 90, 2, 7]
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, 6, 2, 32, 4, dtype, seed=3)
    sinks = _sinks(6)
    scale = 32**-0.5
    calls: list[str] = []

    def spy(name):
        real = getattr(ext, name)

        def wrapped(*args):
            assert args[-1] is sinks  # passed on as it is, last
            calls.append(name)
            return real(*args)

        monkeypatch.setattr(ext, name, wrapped)

    suffix = "" if dtype == torch.float32 else "_bf16"
    spy("paged_decode_attention" + suffix)
    has_prefill = ext.prefill_attention_available() and (
        dtype == torch.float32 or cpu_features.has_bf16_units()
    )
    if has_prefill:
        spy("paged_prefill_attention" + suffix)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2e-2}
    for window in (None, 8):
        calls.clear()
        expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale, window, sinks=sinks)
        out = paged_attention_cpu(q, kc, vc, meta, scale, window, sinks=sinks)
        torch.testing.assert_close(out.double(), expected, **tol)
        prefills = 2 if has_prefill and window is None else 0
        assert (
            calls
            == ["paged_decode_attention" + suffix] + ["paged_prefill_attention" + suffix] * prefills
        )


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (4, 3.0)])
@pytest.mark.parametrize("case", ["decode", "mixed", "chunked"])
def test_int8_cache(cpu_path, case, window, softcap):
    q_lens, kv_lens = CASES[case]
    q, kc, vc, meta, _, _ = make_paged_batch(q_lens, kv_lens, 6, 2, 32, 4, seed=1)
    kq, ks = quantize_kv_ref(kc)
    vq, vs = quantize_kv_ref(vc)
    sinks = _sinks(6)
    ref = paged_attention_ref(q, kq, vq, meta, SCALE, window, softcap, ks, vs, sinks=sinks)
    out = paged_attention(q, kq, vq, meta, SCALE, window, softcap, ks, vs, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = paged_attention_ref(q, kc, vc, meta, SCALE, window, softcap, sinks=sinks)
    assert float((out - exact).abs().max()) < 0.05  # the quantization error only


# -- Triton --------------------------------------------------------------------------------------


def _meta_to(meta, device):
    for name in ("block_tables", "q_start_loc", "q_lens", "kv_lens"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_triton_matches_dense(triton_device, case, window, softcap):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch(case, 4, heads=(6, 2), seed=1)
    sinks = _sinks(6)
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, SCALE, window, softcap, sinks)
    dev = [t.to(triton_device) for t in (q, kc, vc, sinks)]
    meta = _meta_to(meta, triton_device)
    out = paged_attention_triton(*dev[:3], meta, SCALE, window, softcap, sinks=dev[3])
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)
    # through the dispatcher (on CUDA only: it sends CPU tensors to the CPU path)
    if triton_device == "cuda":
        out = paged_attention(*dev[:3], meta, SCALE, window, softcap, sinks=dev[3])
        torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 3])
def test_triton_int8_and_float16(triton_device, dtype, window):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q_lens, kv_lens = CASES["mixed"]
    q, kc, vc, meta, _, _ = make_paged_batch(q_lens, kv_lens, 8, 2, 32, 4, seed=2)
    kq, ks = quantize_kv_ref(kc)
    vq, vs = quantize_kv_ref(vc)
    sinks = _sinks(8)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    q16, kc16, vc16 = q.to(dtype), kc.to(dtype), vc.to(dtype)
    int8_ref = paged_attention_ref(q, kq, vq, meta, SCALE, window, None, ks, vs, sinks=sinks)
    ref = paged_attention_ref(q16, kc16, vc16, meta, SCALE, window, sinks=sinks).float()
    meta = _meta_to(meta, triton_device)
    qd, kq, vq, ks, vs, kc16, vc16, sinks = (
        t.to(triton_device) for t in (q16, kq, vq, ks, vs, kc16, vc16, sinks)
    )
    out = paged_attention_triton(qd, kq, vq, meta, SCALE, window, None, ks, vs, sinks=sinks)
    torch.testing.assert_close(out.cpu().float(), int8_ref, rtol=tol, atol=tol)
    out = paged_attention_triton(qd, kc16, vc16, meta, SCALE, window, sinks=sinks)
    torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol)


def test_triton_rejects_bad_sinks(triton_device):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q, kc, vc, meta, _, _ = make_paged_batch([2, 1], [2, 5], 4, 2, 16, 4)
    q, kc, vc = q.to(triton_device), kc.to(triton_device), vc.to(triton_device)
    meta = _meta_to(meta, triton_device)
    for bad in (torch.zeros(3), torch.zeros(4).half()):
        with pytest.raises(ValueError, match="sinks must be float32"):
            paged_attention_triton(q, kc, vc, meta, 1.0, sinks=bad.to(triton_device))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixed", "long"])
@pytest.mark.parametrize("window", [None, 5])
def test_triton_bfloat16_on_cuda(case, window):
    """bfloat16 on a GPU (the Triton interpreter cannot multiply bfloat16)."""
    q_lens, kv_lens, q, kc, vc, meta, dk, dv = _batch(
        case, 16, heads=(8, 2), head_dim=64, dtype=torch.bfloat16, seed=5
    )
    sinks = _sinks(8)
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, 64**-0.5, window, sinks=sinks)
    meta = _meta_to(meta, "cuda")
    dev = [t.cuda() for t in (q, kc, vc, sinks)]
    out = paged_attention(*dev[:3], meta, 64**-0.5, window, sinks=dev[3])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().double(), expected, rtol=3e-2, atol=3e-2)
