"""`quant_policy="gguf"`: a model loaded from a GGUF file computes with the file's own blocks.

After patching, every decoder linear (merged ones too, whatever mix of types their parts have)
whose weights the file stores as Q4_0, Q4_1, Q8_0, Q4_K or Q6_K becomes a `GGUFLinear`
(models/layers.py) holding those blocks instead of their float32 expansion.
Before it replaces a linear, the blocks' expansion is compared with the linear's float weight
bit for bit, so a file that does not match the checkpoint is an error, never a silently
different model. Embeddings and norms stay in floating point. So does the LM head, which keeps
its float32 weight (a tied embedding's lookups share it) for steps of more than 8 rows but
computes the few rows of decode steps on the file's blocks of it (`GGUFHead`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmengine.engine.gguf_blocks import GGUFWeight, read_gguf_blocks
from lmengine.engine.malloc import release_freed_memory
from lmengine.kernels.gguf import check_qtype, gemv_kernel
from lmengine.models.layers import GGUFLinear, MergedLinear, PackedLinear

logger = logging.getLogger("lmengine")


class GGUFHead(PackedLinear):
    """The LM head as a float32 PackedLinear (weight, packs and hooks as they were) that also
    holds the file's blocks of its weight: 1 to 8 rows (decode) stream the blocks, 3.8x fewer
    bytes for Q8_0 (SmolLM2's 49,152 x 576 head: 0.9 ms a row against 2.7 ms in float32 on
    the Xeon of docs/gguf.md); more rows take the float32 GEMM, as expanding the blocks at
    every step would cost more than it saves."""

    blocks: torch.Tensor
    qtype: int

    @classmethod
    def convert(cls, module: PackedLinear, weight: GGUFWeight) -> GGUFHead:
        check_qtype(weight.qtype, module.in_features, weight.blocks.shape[1])
        module.__class__ = cls
        module.register_buffer("blocks", weight.blocks.to(module.weight.device), persistent=False)
        module.qtype = weight.qtype
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = gemv_kernel(x)
        if gemv is None:
            return super().forward(x)
        return gemv(x.contiguous(), self.blocks, self.qtype, self.bias)


def _head_blocks(model: nn.Module, blocks: dict[str, GGUFWeight]) -> GGUFWeight | None:
    """The blocks of the LM head: the file's output head, or its token embedding when the model
    ties the two; None when the file stores it in another type."""
    head = model.get_output_embeddings()
    weight = blocks.get("lm_head.weight")
    if weight is None and head.weight is model.get_input_embeddings().weight:
        weight = blocks.get("model.embed_tokens.weight")
    return weight


def _check_expands_to(expanded: torch.Tensor, module: nn.Module, name: str, gguf_file: str):
    if not torch.equal(expanded, module.weight.detach().float().cpu()):
        raise ValueError(
            f"{gguf_file}: the blocks of {name} do not expand to the loaded weights: the "
            "file is not the one this checkpoint was converted from"
        )


def _blocks_for(name: str, module: PackedLinear, blocks: dict[str, GGUFWeight]):
    """The GGUFWeights of the linear `name` (one per part of a MergedLinear), or None when the
    file has no blocks for some part."""
    if isinstance(module, MergedLinear):
        parent = name.rsplit(".", 1)[0]
        parts = [blocks.get(f"{parent}.{source}.weight") for source in module.source_names]
    else:
        parts = [blocks.get(f"{name}.weight")]
    return None if any(p is None for p in parts) else parts


def apply_gguf(model: nn.Module, gguf_file: str | None, required: bool = True) -> nn.Module:
    """Replace the patched model's linears by GGUFLinears over `gguf_file`'s blocks. Not
    `required` (the default policy): a file whose blocks cannot be used (another architecture,
    no linear in a supported type) leaves the model on its float32 expansion."""
    if gguf_file is None:  # only quant_policy='gguf' asks for blocks without a file
        raise ValueError(
            "quant_policy='gguf' needs a model loaded from a .gguf file (or the default model)"
        )
    try:
        blocks = read_gguf_blocks(gguf_file)
    except ValueError as e:
        if required:
            raise
        logger.info("%s: computing on the float32 expansion (%s)", gguf_file, e)
        return model
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, PackedLinear) or name.endswith("lm_head"):
            continue
        parts = _blocks_for(name, module, blocks)
        if parts is None:
            continue
        expanded = torch.cat([part.dequantize() for part in parts])
        _check_expands_to(expanded, module, name, gguf_file)
        new = GGUFLinear(
            [(part.blocks.to(module.weight.device), part.qtype) for part in parts],
            module.in_features,
            module.bias,
            getattr(module, "source_names", None),
            getattr(module, "output_sizes", None),
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced += 1
    if replaced == 0 and not required:
        logger.info("%s: no linear in a supported block type; float32 expansion", gguf_file)
        return model
    if replaced == 0:
        raise ValueError(f"{gguf_file}: no linear of the model is stored in a supported block type")
    head = model.get_output_embeddings()
    head_weight = _head_blocks(model, blocks)
    if isinstance(head, PackedLinear) and head_weight is not None:
        _check_expands_to(head_weight.dequantize(), head, "the LM head", gguf_file)
        GGUFHead.convert(head, head_weight)
    logger.info("quant_policy='gguf': %d linears compute on %s's blocks", replaced, gguf_file)
    # the ModelAgent sizes the KV pool from the free memory next: without the float32 weights
    release_freed_memory(next(model.parameters()).device)
    return model
