"""SwiGLU's product silu(gate) * up of a fused gate/up projection output, and the gated
activations that combine gate and up themselves (gpt-oss's `ClampedSwiGLU`).

`silu_mul_ref` is the reference (torch's silu, then the multiply). On the CPU in float32 the
compiled kernel (csrc/layer_ops.cpp) does it in one pass, within a few ulp of the reference
(its exp is a polynomial within 2 ulp of expf), instead of the split, silu and multiply ops. In
bfloat16 its own compiled pass (csrc/bf16_ops.cpp) rounds silu(gate) to bfloat16 before the
multiply, as the reference's two ops do. On CUDA and in other dtypes `silu_mul` is the
reference: those two ops are not where a GPU step's time goes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

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


class GatedActivation:
    """An activation of a gated MLP that combines gate and up itself: `act(gate, up)` ->
    [..., inter]. The rule of the kernels that take an `act_fn` (fused_moe): an instance of this
    class is called as act_fn(gate, up); any other callable is an activation of the gate alone,
    applied as act_fn(gate) * up."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU(GatedActivation):
    """gpt-oss's gated activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = clamp(gate, max=limit) (transformers' GptOssExperts._apply_gate on already split gate
    and up). The same torch ops in the same order, so in bfloat16 it rounds where transformers
    rounds: alpha * g, the sigmoid, the glu product, up + 1 and the final product."""

    alpha: float
    limit: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.alpha):
            raise ValueError(f"ClampedSwiGLU: alpha must be finite, got {self.alpha}")
        if not (math.isfinite(self.limit) and self.limit > 0):
            raise ValueError(f"ClampedSwiGLU: limit must be finite and > 0, got {self.limit}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


def gated(
    act_fn: Callable[[torch.Tensor], torch.Tensor] | GatedActivation,
    gate: torch.Tensor,
    up: torch.Tensor,
) -> torch.Tensor:
    """act_fn(gate, up) for a GatedActivation, act_fn(gate) * up for any other callable."""
    if isinstance(act_fn, GatedActivation):
        return act_fn(gate, up)
    return act_fn(gate) * up
