"""Int8 KV cache kernels against their PyTorch references (lmengine/kernels/kv_quant.py).

Every path (fill on CPU and in Triton; attention through the reference, the CPU gather path,
the compiled decode kernel and Triton) must compute attention over the *dequantized* cache: it
is compared with paged_attention_ref on the same int8 cache at float32 tolerances. The
quantization error itself is bounded separately, against float32 attention.
"""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.fill_kv_cache import fill_kv_cache, fill_kv_cache_ref
from lmengine.kernels.kv_quant import dequantize_kv, dequantize_kv_ref, quantize_kv_ref
from lmengine.kernels.paged_attention import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_ref,
)
from tests.kernels.helpers import make_paged_batch


def _quantized_batch(q_lens, kv_lens, heads, head_dim, block_size, seed=0):
    """make_paged_batch with its caches quantized: (q, kq, vq, ks, vs, meta, kc, vc)."""
    q, kc, vc, meta, _, _ = make_paged_batch(
        q_lens, kv_lens, heads[0], heads[1], head_dim, block_size, seed=seed
    )
    kq, ks = quantize_kv_ref(kc)
    vq, vs = quantize_kv_ref(vc)
    return q, kq, vq, ks, vs, meta, kc, vc


def test_quantize_roundtrip_error_is_half_a_step():
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    x[7, 1] = 0.0  # an all-zero row
    q, s = quantize_kv_ref(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (50, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    back = dequantize_kv_ref(q, s)
    assert bool(((back - x).abs() <= s[..., None] / 2 + 1e-6).all())
    assert bool((q[7, 1] == 0).all()) and float(s[7, 1]) == 0.0
    torch.testing.assert_close(dequantize_kv(q, s), back)


def test_cpu_fill_matches_reference():
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 9, 2, 16, generator=gen)
    slots = torch.tensor([3, 0, 17, 8, 9, 30, 31, 12, 5])
    caches = [torch.zeros(8, 4, 2, 16, dtype=torch.int8) for _ in range(4)]
    scales = [torch.zeros(8, 4, 2) for _ in range(4)]
    fill_kv_cache(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    fill_kv_cache_ref(k, v, caches[2], caches[3], slots, scales[2], scales[3])
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(caches[a], caches[b]) and torch.equal(scales[a], scales[b])
    with pytest.raises(ValueError, match="int8 cache needs"):
        fill_kv_cache(k, v, caches[0], caches[1], slots)


CASES = [
    ([1, 1, 1], [5, 17, 32]),  # decodes only
    ([7], [7]),  # a fresh prompt
    ([5, 1, 16, 1], [5, 9, 40, 1]),  # mixed
    ([3, 12], [20, 12]),  # chunked prefill
]


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0), (4, 3.0)])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("use_kernel", [True, False])
def test_cpu_attention_matches_reference(monkeypatch, case, window, softcap, use_kernel):
    if not use_kernel:
        monkeypatch.setattr(cpu_ext, "load", lambda: None)  # the SDPA path for decodes too
    q_lens, kv_lens = CASES[case]
    q, kq, vq, ks, vs, meta, kc, vc = _quantized_batch(q_lens, kv_lens, (6, 2), 32, 4, seed=case)
    scale = 32**-0.5
    ref = paged_attention_ref(q, kq, vq, meta, scale, window, softcap, ks, vs)
    out = paged_attention(q, kq, vq, meta, scale, window, softcap, ks, vs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the quantization error itself: small against attention over the float32 cache
    exact = paged_attention_ref(q, kc, vc, meta, scale, window, softcap)
    assert float((out - exact).abs().max()) < 0.05


def test_compiled_int8_decode_kernel_is_used_and_exact(ext):
    q_lens, kv_lens = [1, 1, 1, 1], [1, 16, 47, 64]
    q, kq, vq, ks, vs, meta, _, _ = _quantized_batch(q_lens, kv_lens, (9, 3), 64, 16, seed=3)
    scale = 64**-0.5
    tables = meta.block_tables.contiguous()
    out = ext.paged_decode_attention_int8(q, kq, vq, ks, vs, tables, meta.kv_lens, scale, 0, 0.0)
    ref = paged_attention_ref(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="int8"):
        ext.paged_decode_attention_int8(q, kq.float(), vq, ks, vs, tables, meta.kv_lens, scale)


def test_float16_queries_use_the_gather_path():
    q_lens, kv_lens = [1, 4], [9, 4]
    q, kq, vq, ks, vs, meta, _, _ = _quantized_batch(q_lens, kv_lens, (4, 4), 16, 4, seed=5)
    ref = paged_attention_ref(q, kq, vq, meta, 0.25, k_scale=ks, v_scale=vs)
    out = paged_attention_cpu(q.half(), kq, vq, meta, 0.25, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=5e-3, atol=5e-3)


def test_triton_fill_matches_reference(triton_device):
    from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 6, 3, 24, generator=gen)  # head_dim 24: padded to 32 in the kernel
    slots = torch.tensor([3, -1, 17, 8, 0, 30])  # -1: a padding token, writes nothing
    shape = (8, 4, 3, 24)
    kc, vc = (torch.zeros(shape, dtype=torch.int8, device=triton_device) for _ in range(2))
    ks, vs = (torch.full(shape[:3], -1.0, device=triton_device) for _ in range(2))
    dev = [t.to(triton_device) for t in (k, v, slots)]
    fill_kv_cache_triton(dev[0], dev[1], kc, vc, dev[2], ks, vs)
    kr, vr = (torch.zeros(shape, dtype=torch.int8) for _ in range(2))
    ksr, vsr = (torch.full(shape[:3], -1.0) for _ in range(2))
    keep = slots >= 0
    fill_kv_cache_ref(k[keep], v[keep], kr, vr, slots[keep], ksr, vsr)
    for got, want in ((kc, kr), (vc, vr)):
        diff = (got.cpu().int() - want.int()).abs()
        assert int(diff.max()) <= 1  # rounding ties only
        assert float((diff == 0).float().mean()) > 0.99
    torch.testing.assert_close(ks.cpu(), ksr)
    torch.testing.assert_close(vs.cpu(), vsr)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, 4.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_attention_matches_reference(triton_device, window, softcap, dtype):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q_lens, kv_lens = [5, 1, 12, 1], [5, 9, 20, 1]
    q, kq, vq, ks, vs, meta, _, _ = _quantized_batch(q_lens, kv_lens, (8, 2), 32, 4, seed=2)
    scale = 32**-0.5
    ref = paged_attention_ref(q, kq, vq, meta, scale, window, softcap, ks, vs)
    for name in ("block_tables", "q_start_loc", "q_lens", "kv_lens"):
        setattr(meta, name, getattr(meta, name).to(triton_device))
    dev = [t.to(triton_device) for t in (kq, vq, ks, vs)]
    qd = q.to(dtype).to(triton_device)
    out = paged_attention_triton(qd, dev[0], dev[1], meta, scale, window, softcap, dev[2], dev[3])
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol)
