"""The CPU linear paths (compiled GEMV, oneDNN packed, MKL) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext
from lmengine.kernels import linear as linear_module
from lmengine.kernels.linear import linear, pack_weight


@pytest.fixture(scope="module")
def ext():
    module = cpu_ext.load()
    assert module is not None, "the CPU kernels failed to build (see the warning above)"
    return module


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


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("in_features", [16, 48, 576])  # K % 32: 16, 16, 0
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_matches_f_linear(ext, rows, in_features, threads):
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
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ext.gemv(torch.randn(9, 32), w)
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

    def counting_gemv(x, weight, bias):
        calls.append(x.shape[0])
        return ext.gemv(x, weight, bias)

    monkeypatch.setattr(linear_module, "_gemv_kernel", lambda: counting_gemv)
    weight = torch.randn(40, 32)
    packed = pack_weight(weight)
    for rows in (1, 8, 9, 64):
        linear(torch.randn(rows, 32), weight, None, packed)
    linear(torch.randn(1, 32), weight, None, None)  # not packed: not a CPU float32 weight
    assert calls == [1, 8]


@pytest.mark.parametrize("intel", [True, False])
def test_large_gemms_go_to_mkl_on_intel_only(intel, monkeypatch):
    onednn_rows = []

    def counting_onednn(x, packed, bias):
        onednn_rows.append(x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    monkeypatch.setattr(linear_module, "_onednn", counting_onednn)
    monkeypatch.setattr(linear_module, "mkl_wins_large_gemms", lambda: intel)
    monkeypatch.setattr(linear_module, "_gemv_kernel", lambda: None)
    weight = torch.randn(40, 32)
    for rows in (1, 9, 1023, 1024, 3000):
        x = torch.randn(rows, 32)
        out = linear(x, weight, None, pack_weight(weight))
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert onednn_rows == ([9, 1023] if intel else [1, 9, 1023, 1024, 3000])


def test_cpu_vendor_and_override(monkeypatch):
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n"
    assert linear_module.is_intel_cpu(intel)
    assert not linear_module.is_intel_cpu(intel.replace("GenuineIntel", "AuthenticAMD", 1))
    assert linear_module.is_intel_cpu("processor\t: 0\n")  # no vendor listed (not x86)
    for value, expected in (("mkl", True), ("onednn", False)):
        monkeypatch.setenv("LMENGINE_LARGE_GEMM", value)
        linear_module.mkl_wins_large_gemms.cache_clear()
        assert linear_module.mkl_wins_large_gemms() is expected
    monkeypatch.delenv("LMENGINE_LARGE_GEMM")
    linear_module.mkl_wins_large_gemms.cache_clear()
