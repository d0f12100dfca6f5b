"""The Triton GEMM on GGUF blocks (Q4_0, Q4_1, Q8_0) against x @ the gguf package's own
expansion, in the interpreter on CPU (TRITON_INTERPRET=1, the default here) or on a GPU
(TRITON_INTERPRET=0); and `gguf_linear` dispatching CUDA tensors to it (GPU only)."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels.gguf import QTYPES, TRITON_QTYPES, gguf_linear
from tests.kernels.test_gguf import quantized

TYPES = [name for name, qtype in QTYPES.items() if qtype in TRITON_QTYPES]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(1, 7, 32), (5, 70, 96), (33, 64, 64)])  # (M, N, K)
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_gguf_gemm_equals_the_expanded_weights(triton_device, name, shape, with_bias):
    from lmengine.kernels.triton.gguf import gguf_gemm_triton

    m, n, k = shape
    blocks, expanded = quantized(name, n, k, seed=m)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = gguf_gemm_triton(
        x.to(triton_device),
        blocks.to(triton_device),
        QTYPES[name],
        None if bias is None else bias.to(triton_device),
    ).cpu()
    ref = x.double() @ expanded.double().T + (bias.double() if with_bias else 0)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_triton_gguf_gemm_rejects_bad_inputs(triton_device):
    from lmengine.kernels.triton.gguf import gguf_gemm_triton

    blocks, _ = quantized("Q4_1", 8, 64)
    blocks = blocks.to(triton_device)
    with pytest.raises(ValueError, match="float32"):
        gguf_gemm_triton(torch.randn(2, 64, dtype=torch.float16).to(triton_device), blocks, 3)
    with pytest.raises(ValueError, match="a row of 64 weights takes 40 bytes, got 20"):
        gguf_gemm_triton(torch.randn(2, 64).to(triton_device), blocks[:, :20], 3)
    with pytest.raises(ValueError, match="type 13 is not supported"):
        gguf_gemm_triton(torch.randn(2, 64).to(triton_device), blocks, 13)
    q4_k, _ = quantized("Q4_K", 8, 256)
    with pytest.raises(ValueError, match="Q4_K blocks are not supported"):
        gguf_gemm_triton(torch.randn(2, 256).to(triton_device), q4_k.to(triton_device), 12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_gguf_linear_runs_cuda_tensors_on_the_triton_kernel(rows):
    blocks, expanded = quantized("Q4_0", 96, 576)
    x = torch.randn(rows, 576)
    got = gguf_linear(x.cuda(), blocks.cuda(), QTYPES["Q4_0"], 576)
    assert got.is_cuda
    ref = x.double() @ expanded.double().T
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-4)
