"""GGUF's block types that lmengine computes with: their ids, sizes and the check of a row of
blocks (shared by the CPU kernels of `lmengine.kernels.gguf` and the Triton kernel)."""

from __future__ import annotations

# name -> ggml's type id (gguf.GGMLQuantizationType), weights per block, bytes per block
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
_NAMES = {v: k for k, v in QTYPES.items()}
TRITON_QTYPES = (2, 3, 8)  # the Triton GEMM's types (CUDA expands the K types per call)


def check_qtype(qtype: int, k: int, row_bytes: int | None = None) -> str:
    """The type's name; ValueError naming an unsupported type (and the supported ones) or a
    row length that does not fit it."""
    name = _NAMES.get(qtype)
    if name is None:
        supported = ", ".join(f"{n} ({i})" for n, i in QTYPES.items())
        raise ValueError(f"GGUF quantization type {qtype} is not supported: {supported}")
    weights, nbytes = BLOCK_WEIGHTS[name], BLOCK_BYTES[name]
    if k <= 0 or k % weights:
        raise ValueError(f"GGUF {name}: rows must hold a multiple of {weights} weights, got {k}")
    if row_bytes is not None and row_bytes != k // weights * nbytes:
        raise ValueError(
            f"GGUF {name}: a row of {k} weights takes {k // weights * nbytes} bytes, "
            f"got {row_bytes}"
        )
    return name
