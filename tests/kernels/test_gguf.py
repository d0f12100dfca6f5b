"""GGUF block kernels (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) against the `gguf` package's own
quantization and dequantization: the expansion to float32 is bit for bit the package's, in the
compiled kernel and in the PyTorch reference; the weight-only GEMV and GEMM equal
x @ expansion^T up to float32 summation order; bad types and row lengths are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.gguf import (
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    QTYPES,
    dequantize,
    dequantize_ref,
    gguf_linear,
)

gguf = pytest.importorskip("gguf")
TYPES = list(QTYPES)
SHAPES = [(40, 96), (96, 576), (7, 32)]  # (N, K): small, SmolLM2's hidden size, one block


def random_k_blocks(name: str, n: int, k: int, rng, scale: float = 1.0) -> np.ndarray:
    """Random Q4_K / Q6_K blocks uint8 [n, row bytes] (the gguf package cannot quantize to the
    K types): random quants and sub-block scales, half scales drawn so that the weights are
    about `scale` in size."""
    data = rng.integers(0, 256, (n * k // 256, BLOCK_BYTES[name]), dtype=np.uint8)

    def halves(low: float, high: float) -> np.ndarray:
        values = rng.uniform(low * scale, high * scale, (len(data), 1))
        return values.astype(np.float16).view(np.uint8)

    if name == "Q4_K":  # d, dmin
        data[:, 0:2], data[:, 2:4] = halves(1e-3, 3e-3), halves(5e-3, 2e-2)
    else:  # d
        data[:, 208:210] = halves(1e-4, 5e-4)
    return data.reshape(n, -1)


def quantized(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by the gguf package (random blocks in the K types): (uint8
    blocks [n, row bytes], the package's float32 expansion [n, k])."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, name)
    if name in ("Q4_K", "Q6_K"):
        data = random_k_blocks(name, n, k, rng)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[:, 3] += 0.5  # an outlier column: blocks with different scales and minima
        data = gguf.quants.quantize(w, qtype)
    expanded = gguf.quants.dequantize(data, qtype).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(data)), torch.from_numpy(expanded)


def fit(name: str, k: int) -> int:
    """`k` rounded up to a whole number of the type's blocks (256 weights in the K types)."""
    return -(-k // BLOCK_WEIGHTS[name]) * BLOCK_WEIGHTS[name]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_expansion_is_the_gguf_packages_bit_for_bit(name, shape, cpu_path):
    n, k = shape[0], fit(name, shape[1])
    blocks, expected = quantized(name, n, k)
    assert blocks.shape == (n, k // BLOCK_WEIGHTS[name] * BLOCK_BYTES[name])
    assert torch.equal(dequantize_ref(blocks, QTYPES[name], k), expected)
    assert torch.equal(dequantize(blocks, QTYPES[name], k), expected)


@pytest.mark.parametrize("name", TYPES)
# 9, 33, 80: past the GEMV, on the tiled GEMM; 81: past it, on the expansion
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 33, 80, 81])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("inference", [False, True])
def test_linear_equals_the_expanded_weights(name, rows, with_bias, inference, cpu_path):
    """Also under torch.inference_mode, as the engine runs it."""
    n, k = 1000, fit(name, 576)
    blocks, expanded = quantized(name, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    with torch.inference_mode(inference):
        got = gguf_linear(x, blocks, QTYPES[name], k, bias)
    ref = x.double() @ expanded.double().T + (bias.double() if with_bias else 0)
    # float32 sums of 576 products in another order than the float64 reference
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13])  # register tiles of 6 rows, and the rest
@pytest.mark.parametrize("n", [1, 3, 4, 37, 70])  # tiles of 4 outputs, panels of 32, and tails
def test_tiled_gemm_covers_every_tile_and_panel_edge(name, rows, n, ext):
    k = fit(name, 96)
    blocks, expanded = quantized(name, n, k, seed=n)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    got = ext.gguf_gemm(x, blocks, QTYPES[name], bias)
    ref = x.double() @ expanded.double().T + bias.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ext.gguf_gemm(x, blocks, QTYPES[name]), got - bias)


def test_unsupported_type_and_bad_rows_are_clear_errors():
    blocks, _ = quantized("Q4_1", 4, 64)
    q5_k = int(gguf.GGMLQuantizationType.Q5_K)
    supported = r"Q4_0 \(2\), Q4_1 \(3\), Q8_0 \(8\), Q4_K \(12\), Q6_K \(14\)"
    with pytest.raises(ValueError, match=rf"type 13 is not supported: {supported}"):
        dequantize_ref(blocks, q5_k, 64)
    with pytest.raises(ValueError, match="a row of 64 weights takes 40 bytes, got 20"):
        dequantize_ref(blocks[:, :20], QTYPES["Q4_1"], 64)
    with pytest.raises(ValueError, match="multiple of 32 weights, got 48"):
        gguf_linear(torch.randn(1, 48), blocks, QTYPES["Q4_1"], 48)
    module = cpu_ext.load()
    if module is not None:  # the compiled kernels check on their own too
        with pytest.raises(RuntimeError, match=f"type 13 are not supported: {supported}"):
            module.gguf_dequantize(blocks, q5_k, 64)
        with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):
            module.gguf_gemv(torch.randn(9, 64), blocks, QTYPES["Q4_1"])
