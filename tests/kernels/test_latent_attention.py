"""Attention over a latent cache (DeepSeek's multi-head latent attention, absorbed form): many
query heads over one KV head whose keys are [latent | rope] and whose values are the latent
part, passed as the non-contiguous view v_cache = k_cache[..., :v_head_dim]. Every path (the
reference, the CPU path compiled and eager, the compiled kernels called directly, Triton)
against the dense float64 reference, at DeepSeek's 576 / 512 and at small head dims."""

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
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cpu_and_ref_match_dense(cpu_path, case, shape, block_size, with_sinks):
    num_heads, head_dim, v_head_dim = shape
    q, kc, vc, meta, dk, dv = make_latent_batch(
        *CASES[case], num_heads, head_dim, v_head_dim, block_size, seed=block_size
    )
    assert not vc.is_contiguous() and vc.data_ptr() == kc.data_ptr()
    sinks = _sinks(num_heads) if with_sinks else None
    scale = head_dim**-0.5
    expected = _expected(q, dk, dv, case, scale, sinks=sinks).float()
    ref = paged_attention_ref(q, kc, vc, meta, scale, sinks=sinks)
    out = paged_attention(q, kc, vc, meta, scale, sinks=sinks)
    assert out.shape == (q.shape[0], num_heads, v_head_dim)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window,softcap", [(3, None), (None, 4.0), (5, 2.0)])
def test_window_and_softcap(cpu_path, case, window, softcap):
    q, kc, vc, meta, dk, dv = make_latent_batch(*CASES[case], 8, 24, 16, 4, seed=1)
    q = q * 2
    sinks = _sinks(8)
    expected = _expected(q, dk, dv, case, 0.3, window, softcap, sinks).float()
    out = paged_attention(q, kc, vc, meta, 0.3, window, softcap, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_values_in_their_own_narrower_cache(cpu_path, case, dtype):
    """v_cache need not be a view: a contiguous cache of narrower values works the same."""
    q, kc, vc, meta, _, dv = make_latent_batch(*CASES[case], 16, 24, 16, 4, dtype, seed=2)
    own = vc.clone()  # contiguous, and not the keys' memory
    kc[..., :16].normal_()  # the keys' first elements are no longer the values
    dk, _ = read_back(kc, kc, meta, CASES[case][1])
    expected = _expected(q, dk, dv, case, 0.25)
    out = paged_attention(q, kc, own, meta, 0.25)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2e-2}
    torch.testing.assert_close(out.double(), expected, **tol)


def read_back(k_cache, v_cache, meta, kv_lens):
    """Each sequence's keys and values, read back from the paged caches."""
    bs = k_cache.shape[1]
    dense_k, dense_v = [], []
    for b, n in enumerate(kv_lens):
        pos = torch.arange(n)
        blocks = meta.block_tables[b].long()[pos // bs]
        dense_k.append(k_cache[blocks, pos % bs])
        dense_v.append(v_cache[blocks, pos % bs])
    return dense_k, dense_v


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", [(16, 24, 16), (16, 576, 512)], ids=["16x24x16", "16x576x512"])
def test_bfloat16(cpu_path, case, shape):
    num_heads, head_dim, v_head_dim = shape
    q, kc, vc, meta, dk, dv = make_latent_batch(
        *CASES[case], num_heads, head_dim, v_head_dim, 16, BF16, seed=3
    )
    sinks = _sinks(num_heads)
    scale = head_dim**-0.5
    expected = _expected(q, dk, dv, case, scale, sinks=sinks)
    out = paged_attention(q, kc, vc, meta, scale, sinks=sinks)
    assert out.dtype == BF16 and out.shape == (q.shape[0], num_heads, v_head_dim)
    torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2e-2)


def test_rejects_int8_and_wider_values():
    q, kc, vc, meta, _, _ = make_latent_batch([1, 3], [4, 3], 8, 24, 16, 4)
    kq, ks = quantize_kv_ref(kc)
    with pytest.raises(ValueError, match="int8 cache stores values as wide as keys"):
        paged_attention(q, kq, kq[..., :16], meta, 1.0, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="v's must not exceed it"):
        paged_attention(q[..., :16], kc[..., :16], kc, meta, 1.0)
    with pytest.raises(ValueError, match="alike"):
        paged_attention(q, kc, vc[:, :2], meta, 1.0)


# -- the compiled kernels, called directly and chosen by the CPU path ----------------------------


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


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_cpu_path_takes_the_compiled_kernels(ext, monkeypatch, dtype):
    q_lens, kv_lens = [1, 40, 1, 7], [30, 90, 2, 7]
    q, kc, vc, meta, dk, dv = make_latent_batch(q_lens, kv_lens, 16, 576, 512, 16, dtype)
    scale = 576**-0.5
    calls = []

    def spy(name):
        real = getattr(ext, name)
        monkeypatch.setattr(ext, name, lambda *args: calls.append(name) or real(*args))

    suffix = "" if dtype == torch.float32 else "_bf16"
    spy("paged_decode_attention" + suffix)
    has_prefill = ext.prefill_attention_available() and (
        dtype == torch.float32 or cpu_features.has_bf16_units()
    )
    if has_prefill:
        spy("paged_prefill_attention" + suffix)
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale)
    out = paged_attention_cpu(q, kc, vc, meta, scale)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2e-2}
    torch.testing.assert_close(out.double(), expected, **tol)
    decode, prefill = "paged_decode_attention" + suffix, "paged_prefill_attention" + suffix
    assert calls == [decode] + [prefill] * (2 if has_prefill else 0)


# -- Triton --------------------------------------------------------------------------------------


def _meta_to(meta, device):
    for name in ("block_tables", "q_start_loc", "q_lens", "kv_lens"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_sinks", [False, True])
def test_triton_matches_dense(triton_device, case, shape, with_sinks):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    num_heads, head_dim, v_head_dim = shape
    q, kc, vc, meta, dk, dv = make_latent_batch(*CASES[case], num_heads, head_dim, v_head_dim, 4)
    sinks = _sinks(num_heads) if with_sinks else None
    scale = head_dim**-0.5
    expected = _expected(q, dk, dv, case, scale, sinks=sinks)
    kd = kc.to(triton_device)
    meta = _meta_to(meta, triton_device)
    sd = None if sinks is None else sinks.to(triton_device)
    out = paged_attention_triton(
        q.to(triton_device), kd, kd[..., :v_head_dim], meta, scale, sinks=sd
    )
    assert out.shape == (q.shape[0], num_heads, v_head_dim)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(3, None), (None, 4.0)])
def test_triton_float16_window_softcap(triton_device, window, softcap):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q, kc, vc, meta, _, _ = make_latent_batch(*CASES["mixed"], 16, 24, 16, 4, seed=4)
    q16, kc16 = q.half(), kc.half()
    ref = paged_attention_ref(q16, kc16, kc16[..., :16], meta, 0.25, window, softcap)
    kd = kc16.to(triton_device)
    meta = _meta_to(meta, triton_device)
    out = paged_attention_triton(
        q16.to(triton_device), kd, kd[..., :16], meta, 0.25, window, softcap
    )
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=5e-3, atol=5e-3)


def test_triton_rejects_int8_latent(triton_device):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q, kc, vc, meta, _, _ = make_latent_batch([1, 3], [4, 3], 8, 24, 16, 4)
    kq, ks = quantize_kv_ref(kc)
    dev = [t.to(triton_device) for t in (q, kq, ks)]
    meta = _meta_to(meta, triton_device)
    with pytest.raises(ValueError, match="int8 cache stores values as wide as keys"):
        paged_attention_triton(
            dev[0], dev[1], dev[1][..., :16], meta, 1.0, None, None, dev[2], dev[2]
        )
    with pytest.raises(ValueError, match="values no wider than keys"):
        paged_attention_triton(
            dev[0][..., :16], dev[1][..., :16].float(), kc.to(triton_device), meta, 1.0
        )


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_triton_bfloat16_deepseek_shape_on_cuda(case):
    """bfloat16 at 576 / 512 on a GPU (the Triton interpreter cannot multiply bfloat16)."""
    q, kc, vc, meta, dk, dv = make_latent_batch(*CASES[case], 16, 576, 512, 16, BF16, seed=6)
    sinks = _sinks(16)
    expected = _expected(q, dk, dv, case, 576**-0.5, sinks=sinks)
    meta = _meta_to(meta, "cuda")
    kd = kc.cuda()
    out = paged_attention(q.cuda(), kd, kd[..., :512], meta, 576**-0.5, sinks=sinks.cuda())
    assert out.dtype == BF16 and out.shape == (q.shape[0], 16, 512)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=3e-2, atol=3e-2)
