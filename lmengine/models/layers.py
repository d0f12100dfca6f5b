"""Linear layers of the patched models.

Every linear of a patched model is a `PackedLinear` (one HF linear) or a `MergedLinear` (several
HF linears sharing an input, stacked into one GEMM). Transforms applied after patching (tensor
parallel sharding, w8a8, LoRA) find the linears by these types and by `source_names`, the HF
names of the parts, so they never need to know a model's forward. `quant_policy="gguf"` turns
them into `GGUFLinear`s, which compute on a GGUF file's blocks and keep the same names and
sizes (LoRA finds them too).
"""

from __future__ import annotations

import torch
from torch import nn

from lmengine.kernels.gguf import check_qtype, gguf_linear
from lmengine.kernels.linear import linear, pack_weight


class PackedLinear(nn.Linear):
    """An nn.Linear that runs on a packed copy of its weight (kernels/linear.py) where that is
    faster.

    Whoever changes `weight` afterwards (sharding, quantization) calls `repack()`.
    """

    packed: torch.Tensor | None = None

    @classmethod
    def convert(cls, module: nn.Linear) -> PackedLinear:
        """Turn an nn.Linear into a PackedLinear in place (the parameters stay)."""
        module.__class__ = cls
        module.repack()
        return module

    def repack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)  # [num_tokens, out]


class MergedLinear(PackedLinear):
    """Linears sharing one input, stacked into one weight: one GEMM instead of several.

    Rows `output_sizes[i]` of the output belong to the HF linear named `source_names[i]`.
    """

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        nn.Module.__init__(self)
        parts = list(linears.values())
        weight = torch.cat([lin.weight.detach() for lin in parts], 0)  # [sum_out, in]
        bias = None
        if any(lin.bias is not None for lin in parts):
            zeros = weight.new_zeros
            bias = torch.cat(
                [
                    zeros(lin.out_features) if lin.bias is None else lin.bias.detach()
                    for lin in parts
                ]
            )
        self.in_features = parts[0].in_features
        self.out_features = weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.source_names = list(linears)
        self.output_sizes = [lin.out_features for lin in parts]
        self.repack()

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[num_tokens, sum_out] -> one tensor per source linear."""
        # NOTE: split_with_sizes directly: Tensor.split's Python wrapper costs more than the op
        return out.split_with_sizes(self.output_sizes, dim=-1)


def merge_linears(module: nn.Module, merged_name: str, names: list[str]) -> MergedLinear:
    """Replace the child linears `names` of `module` with one MergedLinear `merged_name`."""
    merged = MergedLinear({name: getattr(module, name) for name in names})
    for name in names:
        delattr(module, name)
    setattr(module, merged_name, merged)
    return merged


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ b) with W as GGUF blocks (kernels/gguf.py), float32 x; it replaces a
    PackedLinear or MergedLinear and keeps its `source_names`, `output_sizes` and `split`.

    `parts`: the blocks of consecutive output rows, each `(blocks uint8 [rows, row bytes],
    qtype)`: a MergedLinear's parts stored in different block types (llama.cpp's mixed `_M` /
    `_S` files: a Q6_K value projection beside Q4_K queries and keys) each run their own
    kernel, parts of one type one kernel together."""

    def __init__(self, parts, in_features: int, bias, source_names=None, output_sizes=None):
        super().__init__()
        runs: list[tuple[list[torch.Tensor], int]] = []
        for blocks, qtype in parts:
            check_qtype(qtype, in_features, blocks.shape[1])  # once, not at every step
            if runs and runs[-1][1] == qtype:
                runs[-1][0].append(blocks)
            else:
                runs.append(([blocks], qtype))
        self.in_features = in_features
        self.qtypes = [qtype for _, qtype in runs]
        self.run_rows = []
        for i, (blocks, _) in enumerate(runs):
            stacked = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
            self.register_buffer(f"blocks{i}", stacked)
            self.run_rows.append(stacked.shape[0])
        self.out_features = sum(self.run_rows)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.source_names = source_names
        self.output_sizes = output_sizes or [self.out_features]

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split_with_sizes(self.output_sizes, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, bias = self.in_features, self.bias
        if len(self.qtypes) == 1:
            return gguf_linear(x, self.blocks0, self.qtypes[0], k, bias, checked=True)
        outs, row = [], 0
        for i, (qtype, rows) in enumerate(zip(self.qtypes, self.run_rows)):
            part_bias = None if bias is None else bias[row : row + rows]
            blocks = getattr(self, f"blocks{i}")
            outs.append(gguf_linear(x, blocks, qtype, k, part_bias, checked=True))
            row += rows
        return torch.cat(outs, dim=-1)
