"""The quantized blocks of a GGUF file, under the names of the model converted from it.

`read_gguf_blocks(path)` returns, for every linear weight stored in a supported block type
(`lmengine.kernels.gguf.QTYPES`; and the token embedding and output head), the uint8 blocks
[out_features, row bytes] that `lmengine.kernels.gguf` computes with, keyed by the
transformers parameter name the converted checkpoint uses
(`model.layers.3.self_attn.q_proj.weight`). The blocks expand bit for bit to that checkpoint's
float32 weights (both are `gguf.quants.dequantize`'s values); `check_blocks` verifies it.

llama.cpp's converter stores the rows of a Llama model's query and key projections reordered
for its rotary layout (per head, the two halves of the rotated dimensions interleaved); the
rows are put back here, as transformers does when it expands the file. A row permutation
moves whole rows of blocks, so the blocks stay as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from lmengine.kernels.gguf import QTYPES, check_qtype, dequantize

# GGUF tensor name (in block N) -> transformers module path (in layer N)
LLAMA_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass
class GGUFWeight:
    """A weight as GGUF blocks: uint8 [out_features, row bytes] of `qtype` (ggml's id)."""

    blocks: torch.Tensor
    qtype: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.blocks, self.qtype, self.in_features)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return value.tobytes().decode() if value.dtype == np.uint8 else value.item()


def _unpermute_rows(blocks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the converter's rotary reordering of a query / key projection's rows."""
    rows = blocks.shape[0]
    half = rows // num_heads // 2
    return blocks.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(rows, -1).contiguous()


def read_gguf_blocks(path: str) -> dict[str, GGUFWeight]:
    """Every linear weight, token embedding and output head that the GGUF file at `path` stores
    in a supported block type, by transformers parameter name. Other tensors (norms, float
    weights) are not included."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError) as e:  # the reader's ways of meeting a cut file
        raise ValueError(
            f"{path} is not a complete GGUF file (truncated or damaged): {type(e).__name__}: {e}"
        ) from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{path}: GGUF blocks are read for Llama-architecture files only, this one is {arch!r}"
        )
    num_heads = _field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or num_heads
    supported = set(QTYPES.values())
    out: dict[str, GGUFWeight] = {}
    for tensor in reader.tensors:
        qtype = int(tensor.tensor_type)
        if qtype not in supported:
            continue
        if tensor.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif tensor.name == "output.weight":
            name = "lm_head.weight"
        else:
            match = _BLOCK_TENSOR.fullmatch(tensor.name)
            if match is None or match.group(2) not in LLAMA_LINEARS:
                continue
            layer, part = match.groups()
            name = f"model.layers.{layer}.{LLAMA_LINEARS[part]}.weight"
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        in_features = int(tensor.shape[0])  # GGUF lists the fastest dimension first
        check_qtype(qtype, in_features, blocks.shape[1])
        if name.endswith("q_proj.weight"):
            blocks = _unpermute_rows(blocks, num_heads)
        elif name.endswith("k_proj.weight"):
            blocks = _unpermute_rows(blocks, num_kv_heads)
        out[name] = GGUFWeight(blocks, qtype, in_features)
    return out


def check_blocks(weights: dict[str, GGUFWeight], state_dict: dict[str, torch.Tensor]) -> None:
    """Assert that every block weight expands exactly to the float32 weight of that name."""
    for name, weight in weights.items():
        expected = state_dict.get(name)
        if expected is None:
            raise ValueError(f"GGUF weight {name} has no counterpart in the converted model")
        if not torch.equal(weight.dequantize(), expected.float()):
            raise ValueError(f"GGUF weight {name} does not expand to the converted model's weight")
