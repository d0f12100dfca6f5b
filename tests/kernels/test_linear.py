"""The CPU linear paths (compiled GEMV, MKL packed, oneDNN packed, MKL) against F.linear."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from lmengine.kernels import linear as linear_module
from lmengine.kernels.linear import linear, pack_weight


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 8, 9, 64, 1100])
@pytest.mark.parametrize("in_features", [48, 40])  # 40: not a multiple of 16, no GEMV
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(70, in_features, generator=gen)
    bias = torch.randn(70, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    out = linear(x, weight, bias, pack_weight(weight))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


# 9-24: in passes, on CPUs without AVX-512
@pytest.mark.parametrize("rows", [*range(1, 10), 12, 13, 17, 24, 25])
@pytest.mark.parametrize("in_features", [16, 48, 576])  # K % 32: 16, 16, 0
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_matches_f_linear(ext, rows, in_features, threads):
    if rows > ext.gemv_max_rows():
        with pytest.raises(RuntimeError, match="rows"):
            ext.gemv(torch.randn(rows, in_features), torch.randn(8, in_features))
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * 1000 + in_features)
        weight = torch.randn(1001, in_features, generator=gen)  # rows split unevenly
        bias = torch.randn(1001, generator=gen)
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
            torch.testing.assert_close(
                ext.gemv(x, weight, b).double(), expected, rtol=1e-5, atol=1e-4
            )
    finally:
        torch.set_num_threads(before)


def test_gemv_rejects_what_it_cannot_run(ext):
    w = torch.randn(8, 32)
    most = ext.gemv_max_rows()
    assert most in (8, 24)
    with pytest.raises(RuntimeError, match=f"1 to {most} rows"):
        ext.gemv(torch.randn(most + 1, 32), w)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.gemv(torch.randn(1, 24), torch.randn(8, 24))
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        ext.gemv(torch.randn(1, 16), w)
    with pytest.raises(RuntimeError, match="bias must be"):
        ext.gemv(torch.randn(1, 32), w, torch.randn(7))
    with pytest.raises(RuntimeError, match="float32"):
        ext.gemv(torch.randn(1, 32).double(), w.double())


def test_linear_takes_the_gemv_for_few_rows_only(ext, monkeypatch):
    calls = []
    real = ext.gemv

    def counting_gemv(x, weight, bias):
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(ext, "gemv", counting_gemv)
    weight = torch.randn(40, 32)
    packed = pack_weight(weight)
    for rows in (1, 8, 9, 16, 17, 64):
        linear(torch.randn(rows, 32), weight, None, packed)
    linear(torch.randn(1, 32), weight, None, None)  # not packed: not a CPU float32 weight
    assert calls == [r for r in (1, 8, 9, 16, 17, 64) if r <= ext.gemv_max_rows()]


@pytest.mark.parametrize("intel", [True, False])
def test_gemms_go_to_mkl_packs_on_intel_and_onednn_elsewhere(ext, intel, monkeypatch):
    if intel and not ext.sgemm_packed_available():
        pytest.skip("this torch has no MKL (not an x86 build)")
    used = []

    def counting(name, fn):
        def run(*args):
            used.append((name, args[0].shape[0]))
            return fn(*args)

        return run

    monkeypatch.setattr(linear_module, "mkl_is_fast", lambda: intel)
    monkeypatch.setattr(ext, "gemv", counting("gemv", ext.gemv))
    monkeypatch.setattr(linear_module, "_onednn", counting("onednn", linear_module._onednn))
    monkeypatch.setattr(ext, "sgemm_packed_linear", counting("mkl", ext.sgemm_packed_linear))
    weight, bias = torch.randn(40, 32), torch.randn(40)
    packed = pack_weight(weight)
    assert packed.dtype == (torch.uint8 if intel else torch.float32)
    all_rows = (1, 8, 9, 17, 117, 1023, 1024, 3000)
    for rows in all_rows:
        x = torch.randn(rows, 32)
        out = linear(x, weight, bias, packed)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    big = "mkl" if intel else "onednn"
    most = ext.gemv_max_rows()
    assert used == [("gemv" if r <= most else big, r) for r in all_rows]


@pytest.mark.parametrize("intel", [True, False])
def test_without_the_compiled_kernels_intel_keeps_mkl_for_large_gemms(intel, monkeypatch):
    onednn_rows = []

    def counting_onednn(x, packed, bias):
        onednn_rows.append(x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    monkeypatch.setattr(linear_module.cpu_ext, "load", lambda: None)
    monkeypatch.setattr(linear_module, "_onednn", counting_onednn)
    monkeypatch.setattr(linear_module, "mkl_is_fast", lambda: intel)
    weight = torch.randn(40, 32)
    packed = pack_weight(weight)
    assert packed.is_mkldnn
    for rows in (1, 9, 1023, 1024, 3000):
        x = torch.randn(rows, 32)
        out = linear(x, weight, None, packed)
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert onednn_rows == ([9, 1023] if intel else [1, 9, 1023, 1024, 3000])


@pytest.fixture()
def mkl(ext):
    if not ext.sgemm_packed_available():
        pytest.skip("this torch has no MKL (not an x86 build)")
    return ext


@pytest.mark.parametrize("rows", [1, 2, 9, 31, 117, 600])
@pytest.mark.parametrize(("out_features", "in_features"), [(3072, 576), (101, 37), (5, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_mkl_packed_gemm_matches_float64(mkl, rows, out_features, in_features, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * 7 + out_features)
        weight = torch.randn(out_features, in_features, generator=gen)
        bias = torch.randn(out_features, generator=gen)
        x = torch.randn(rows, in_features, generator=gen)
        for hint in (64, 512):  # the hint steers the layout, never the result's rows
            packed = mkl.sgemm_pack(weight, hint)
            for b in (None, bias):  # one row with a bias: MKL's beta = 1 was wrong there
                expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
                out = mkl.sgemm_packed_linear(x, packed, weight, b)
                torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-4)
        assert mkl.sgemm_packed_linear(x[:0], packed, weight).shape == (0, out_features)
    finally:
        torch.set_num_threads(before)


def test_mkl_packed_gemm_rejects_what_it_cannot_run(mkl):
    weight = torch.randn(8, 32)
    packed = mkl.sgemm_pack(weight, 512)
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        mkl.sgemm_packed_linear(torch.randn(2, 24), packed, weight)
    with pytest.raises(RuntimeError, match="float32"):
        mkl.sgemm_packed_linear(torch.randn(2, 32).double(), packed, weight)
    with pytest.raises(RuntimeError, match="sgemm_pack"):
        mkl.sgemm_packed_linear(torch.randn(2, 32), weight, weight)  # not a packed buffer
    with pytest.raises(RuntimeError, match="bias must be"):
        mkl.sgemm_packed_linear(torch.randn(2, 32), packed, weight, torch.randn(7))
    with pytest.raises(RuntimeError, match="float32"):
        mkl.sgemm_pack(weight.double(), 512)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_mkl_pack_holds_about_the_weight_in_memory(mkl):
    """MKL asks for 1.4-3x the matrix; only the pages it writes (the matrix's size) are
    resident."""
    weight = torch.randn(49152, 576)  # 108 MiB: SmolLM2's LM head
    before = _resident_bytes()
    packed = mkl.sgemm_pack(weight, 512)
    grown = _resident_bytes() - before
    assert packed.numel() > 1.5 * weight.numel() * 4  # what MKL asked for
    assert grown < 1.2 * weight.numel() * 4, grown
    x = torch.randn(16, 576)
    torch.testing.assert_close(
        mkl.sgemm_packed_linear(x, packed, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4
    )


def test_cpu_vendor_and_override(monkeypatch):
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n"
    assert linear_module.is_intel_cpu(intel)
    assert not linear_module.is_intel_cpu(intel.replace("GenuineIntel", "AuthenticAMD", 1))
    assert linear_module.is_intel_cpu("processor\t: 0\n")  # no vendor listed (not x86)
    for value, expected in (("mkl", True), ("onednn", False)):
        monkeypatch.setenv("LMENGINE_GEMM", value)
        linear_module.mkl_is_fast.cache_clear()
        assert linear_module.mkl_is_fast() is expected
    monkeypatch.delenv("LMENGINE_GEMM")
    linear_module.mkl_is_fast.cache_clear()


def test_bfloat16_without_onednn_support_runs_unpacked(monkeypatch):
    """On a CPU where oneDNN has no bfloat16 path (AVX2 only: AMD Zen 3), a bfloat16 weight
    is not packed (packing would raise) and `linear` is PyTorch's own."""
    monkeypatch.setattr(linear_module, "_onednn_bf16", lambda: False)
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    assert pack_weight(weight) is None
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, weight, None, pack_weight(weight)), F.linear(x, weight))


def test_large_bfloat16_gemms_run_on_rows_padded_to_64(monkeypatch):
    """bfloat16 on oneDNN's plain matmul (1,024+ rows) pads the rows with zeros to a multiple
    of 64, so that prompt steps of ever new row counts reuse a few compiled GEMMs; the result
    is the step's rows, as F.linear computes them (the compiled kernel splits mid-size GEMMs
    between the threads: tests/kernels/test_bf16_ops.py)."""
    from lmengine.kernels.linear import PLAIN, padded_rows

    bf16 = torch.bfloat16
    assert [padded_rows(n, bf16, PLAIN) for n in (5, 1023, 1024, 1025, 2100)] == [
        5,
        1023,
        1024,
        1088,
        2112,
    ]
    assert padded_rows(2100, torch.float32, PLAIN) == 2100
    assert padded_rows(2100, bf16, linear_module.ONEDNN) == 2100
    weight = torch.randn(70, 64, dtype=bf16)
    packed = pack_weight(weight)
    if packed is None:
        pytest.skip("oneDNN computes no bfloat16 on this CPU: nothing is packed")
    seen = []
    real, plain = F.linear, linear_module._plain_bf16

    def spy(x, w, b=None):
        seen.append(x.shape[0])
        return plain(x, w, b)

    monkeypatch.setattr(linear_module, "_plain_bf16", spy)
    for rows in (1024, 1025, 2100):
        x = torch.randn(rows, 64, dtype=bf16)
        out = linear(x, weight, None, packed)
        assert out.shape == (rows, 70)
        torch.testing.assert_close(out, real(x, weight), rtol=1.6e-2, atol=1e-2)
    assert seen == [1024, 1088, 2112]
