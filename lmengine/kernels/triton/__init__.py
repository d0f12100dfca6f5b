"""Triton kernels for the CUDA path of `lmengine.kernels`.

Each module holds one `@triton.jit` kernel and a launcher (`*_triton`) that validates its inputs
and launches it. Only these modules import triton; the dispatchers in `lmengine.kernels` import
them lazily when their inputs live on a CUDA device. Under `TRITON_INTERPRET=1` (set before
triton is imported) the launchers also run on CPU tensors, which is how the tests exercise them.
"""
