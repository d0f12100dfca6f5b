"""W8A8 modules: an RMSNorm that emits int8 activations with per-token scales, and a linear
that runs an int8 GEMM on them (or quantizes a float input per token itself).

They replace, after patching, the patched RMSNorms and `PackedLinear` / `MergedLinear` modules
of the decoder layers (`W8A8_MODULE_MAP`); the model's forward code is unchanged: a norm's
output goes to the linear(s) it feeds and nowhere else, and `QuantizedActivation.shape` answers
the one question the attention forward asks of its input (the number of tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmengine.kernels.w8a8 import (
    AMX_MIN_ROWS,
    QMAX,
    int8_gemm,
    pack_int8_weight,
    pack_int8_weight_amx,
    per_token_quant,
    rms_norm_quant,
    silu_mul_quant_cpu,
    w8a8_linear_cpu,
)
from lmengine.models.llama import PatchedLlamaMLP, PatchedRMSNorm


@dataclass
class QuantizedActivation:
    """int8 activations with their per-token scales, as one RMSNorm output."""

    data: torch.Tensor  # [num_tokens, hidden] int8
    scale: torch.Tensor  # [num_tokens, 1] float32
    dtype: torch.dtype  # the float dtype the consumer's output should have

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


class W8A8RMSNorm(PatchedRMSNorm):
    """RMSNorm (optionally after the residual add) fused with per-token int8 quantization.

    Its weight already carries the SmoothQuant scales (divided in). Only norms whose output
    feeds W8A8Linears are swapped to this class; the final norm stays float.
    """

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        q, scale, summed = rms_norm_quant(x, self.weight, self.variance_epsilon, residual)
        out = QuantizedActivation(q, scale, x.dtype)
        return out if residual is None else (out, summed)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight [out, in] -> (int8 [out, in], scale f32 [out])."""
    wf = weight.detach().to(torch.float32)
    amax = wf.abs().amax(dim=1).clamp(min=1e-8)  # [out]
    q = torch.round(wf * (QMAX / amax)[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


class W8A8Linear(nn.Module):
    """y = x @ W.T + b with W int8 per output channel and x int8 per token (dynamic).

    Takes a `QuantizedActivation` from a W8A8RMSNorm, or a float tensor that it quantizes
    itself. Keeps `source_names` / `output_sizes` / `split` of the MergedLinear it replaces.
    """

    # False where the layer must quantize a float input itself (row-parallel under TP: the
    # ranks agree on the per-token scale first)
    takes_quantized_input = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        has_bias: bool,
        source_names: list[str] | None = None,
        output_sizes: list[int] | None = None,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.source_names = source_names
        self.output_sizes = output_sizes or [out_features]
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )  # [out, in] int8
        self.register_buffer("weight_scale", torch.ones(out_features, device=device))  # [out]
        bias = torch.zeros(out_features, dtype=bias_dtype, device=device) if has_bias else None
        self.register_buffer("bias", bias)  # [out] or None

    @classmethod
    def from_float(cls, linear: nn.Linear, quantize: bool = True) -> W8A8Linear:
        """Quantize a (Packed/Merged) float linear; its weight may already be smoothed.
        quantize=False: same shapes, placeholder values (a checkpoint is loaded next)."""
        w = linear.weight
        module = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            getattr(linear, "source_names", None),
            getattr(linear, "output_sizes", None),
            device=w.device,
            bias_dtype=w.dtype,
        )
        if not quantize:
            return module
        module.weight, module.weight_scale = quantize_weight(w)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def packed_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(oneDNN's int8 matmul layout, the AMX-INT8 GEMM's blocks) of `weight` (CPU), packed
        again whenever `weight` is replaced or changed in place (loading, sharding), else the
        copies made last time. Where the AMX blocks exist they serve every row count the
        oneDNN layout would (2 rows on) and one row too, so that one is not made."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.device, w.shape)
        if getattr(self, "_packed_key", None) != key:
            self._packed_amx = pack_int8_weight_amx(w)
            self._packed = pack_int8_weight(w) if self._packed_amx is None else None
            self._packed_key = key
        return self._packed, self._packed_amx

    def packed_weight(self) -> torch.Tensor | None:
        """`weight` in oneDNN's int8 matmul layout, or None (see `packed_weights`)."""
        return self.packed_weights()[0]

    def forward(self, x: QuantizedActivation | torch.Tensor) -> torch.Tensor:
        packed, packed_amx = (None, None) if self.weight.is_cuda else self.packed_weights()
        if isinstance(x, QuantizedActivation):
            q, scale, dtype = x.data, x.scale, x.dtype
        else:
            if not x.is_cuda and (packed_amx is None or x.shape[0] < AMX_MIN_ROWS):
                # one compiled call: quantize, GEMM, dequantize
                out = w8a8_linear_cpu(x, self.weight, self.weight_scale, self.bias, packed)
                if out is not None:
                    return out
            q, scale = per_token_quant(x)  # [num_tokens, in] int8, [num_tokens, 1]
            dtype = x.dtype
        return int8_gemm(
            q, scale, self.weight, self.weight_scale, self.bias, dtype, packed, packed_amx
        )

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[num_tokens, sum_out] -> one tensor per source linear."""
        return out.split(self.output_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class W8A8LlamaMLP(PatchedLlamaMLP):
    """SwiGLU whose silu(gate) * up is one compiled pass on the CPU, quantized in the same pass
    for the down projection (the eager silu, multiply and quantization are three more passes
    over [num_tokens, intermediate]). Swapped in place: the (W8A8) linears stay."""

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate] float
        if self.down_proj.takes_quantized_input and self.fuses_silu_mul(gate_up):
            quantized = silu_mul_quant_cpu(gate_up)
            if quantized is not None:
                return self.down_proj(QuantizedActivation(*quantized, gate_up.dtype))
        # else the float product: a row-parallel down projection quantizes it with its agreed
        # scale
        return self.down_proj(self.act_mul(gate_up))


# Class of a patched module -> its W8A8 replacement. Linears are rebuilt (`from_float`: the
# parameters change type); norms and MLPs are swapped in place (the weights stay, the forward
# changes).
W8A8_MODULE_MAP: dict[str, str] = {
    "lmengine.models.layers.PackedLinear": "lmengine.models.w8a8.W8A8Linear",
    "lmengine.models.layers.MergedLinear": "lmengine.models.w8a8.W8A8Linear",
    "lmengine.models.llama.PatchedRMSNorm": "lmengine.models.w8a8.W8A8RMSNorm",
    "lmengine.models.llama.PatchedLlamaMLP": "lmengine.models.w8a8.W8A8LlamaMLP",
}
