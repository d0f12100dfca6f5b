"""SwiGLU's product silu(gate) * up of a fused gate/up projection output.

`silu_mul_ref` is the reference (torch's silu, then the multiply). On the CPU in float32 the
compiled kernel (csrc/layer_ops.cpp) does it in one pass, within a few ulp of the reference
(its exp is a polynomial within 2 ulp of expf), instead of the split, silu and multiply ops. In
bfloat16 its own compiled pass (csrc/bf16_ops.cpp) rounds silu(gate) to bfloat16 before the
multiply, as the reference's two ops do. On CUDA and in other dtypes `silu_mul` is the
reference: those two ops are not where a GPU step's time goes.
"""

from __future__ import annotations

import torch

from lmengine.kernels import cpu_ext


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] (gate, then up) -> silu(gate) * up, [num_tokens, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul_compiled_takes(gate_up: torch.Tensor) -> bool:
    """float32 or bfloat16 CPU rows of even width, each row contiguous (a column slice is
    fine)."""
    return (
        not gate_up.is_cuda
        and gate_up.dtype in (torch.float32, torch.bfloat16)
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
        and gate_up.shape[-1] % 2 == 0
    )


def silu_mul_compiled(gate_up: torch.Tensor) -> torch.Tensor | None:
    """The compiled one-pass product, or None where it does not apply (see
    `silu_mul_compiled_takes`) or the kernels are not built."""
    if not silu_mul_compiled_takes(gate_up):
        return None
    ops = cpu_ext.load()
    if ops is None:
        return None
    return (ops.silu_mul if gate_up.dtype == torch.float32 else ops.bf16_silu_mul)(gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the compiled kernel where it applies, else the reference."""
    out = silu_mul_compiled(gate_up)
    return silu_mul_ref(gate_up) if out is None else out
