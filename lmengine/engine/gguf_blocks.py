"""The quantized blocks of a GGUF file, under the names of the model converted from it.

`read_gguf_blocks(path)` returns, for every linear weight stored in a supported block type
(`lmengine.kernels.gguf.QTYPES`; and the token embedding and output head), the uint8 blocks
[out_features, row bytes] that `lmengine.kernels.gguf` computes with, keyed by the
transformers parameter name the converted checkpoint uses
(`model.layers.3.self_attn.q_proj.weight`). The blocks expand bit for bit to that checkpoint's
float32 weights (both are `gguf.quants.dequantize`'s values); `check_blocks` verifies it.

Blocks are read for the architectures of `BLOCK_ARCHITECTURES`, whose attention and dense MLP
linears carry Llama's tensor names (a Qwen3-MoE file's experts are not read: they stay float32).
llama.cpp's converter stores the rows of a Llama model's query and key projections reordered
for its rotary layout (per head, the two halves of the rotated dimensions interleaved); the
rows are put back here, as transformers does when it expands the file. A row permutation
moves whole rows of blocks, so the blocks stay as they are. Gemma 3's and Qwen3-MoE's rows are
stored in transformers' order.

`open_gguf(path)` opens a file for reading, with a clear error for a cut one or for a tensor
type the installed gguf package does not know. It keeps the last files it opened: parsing a
file's metadata takes seconds for a large vocabulary, and loading a file opens it for the
expansion's check and again for its blocks.
"""

from __future__ import annotations

import os
import re
import threading
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
# GGUF architecture whose linears are read -> whether llama.cpp reordered its query / key rows
BLOCK_ARCHITECTURES = {"llama": True, "gemma3": False, "qwen3moe": False}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_UNKNOWN_TYPE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")


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


def gguf_field(reader, key: str):
    """The value of the metadata field `key` (a number or a string), None where it is absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return value.tobytes().decode() if value.dtype == np.uint8 else value.item()


def read_gguf_tensor(tensor) -> torch.Tensor:
    """A GGUF tensor (of a `gguf.GGUFReader`) dequantized to float32, in transformers'
    dimension order (GGUF lists the fastest dimension first)."""
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(data.reshape(tuple(reversed(tensor.shape.tolist()))).copy())


def _unpermute_rows(blocks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the converter's rotary reordering of a query / key projection's rows."""
    rows = blocks.shape[0]
    half = rows // num_heads // 2
    return blocks.reshape(num_heads, half, 2, -1).transpose(1, 2).reshape(rows, -1).contiguous()


# the readers open_gguf parsed last, by (real path, inode, size, time of change in ns): a file
# written again is parsed again
_READERS: dict[tuple, object] = {}
_MAX_READERS = 2
_READERS_LOCK = threading.Lock()


def open_gguf(path: str):
    """A `gguf.GGUFReader` over the file at `path` (memory-mapped: no tensor is read yet),
    the one opened before while the file is unchanged (readers are only read from).
    Raises ValueError for a truncated or damaged file, and for a tensor type unknown to the
    installed gguf package (a file newer than the package), naming the type's id."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is None:
            reader = _parse_gguf(path)
            if len(_READERS) >= _MAX_READERS:
                del _READERS[next(iter(_READERS))]  # the oldest
            _READERS[key] = reader
        return reader


def _parse_gguf(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except ValueError as e:
        unknown = _UNKNOWN_TYPE.search(str(e))  # "np.uint32(42) is not a valid GGMLQuant..."
        if unknown is not None:
            raise ValueError(
                f"{path} holds a tensor of GGML type {unknown.group(1)}, a type the installed gguf "
                "package does not know: upgrade it (pip install -U gguf)"
            ) from None
        raise ValueError(
            f"{path} is not a complete GGUF file (truncated or damaged): {type(e).__name__}: {e}"
        ) from None
    except (IndexError, KeyError) as e:  # the reader's other ways of meeting a cut file
        raise ValueError(
            f"{path} is not a complete GGUF file (truncated or damaged): {type(e).__name__}: {e}"
        ) from None


def read_gguf_blocks(path: str) -> dict[str, GGUFWeight]:
    """Every linear weight, token embedding and output head that the GGUF file at `path` stores
    in a supported block type, by transformers parameter name. Other tensors (norms, float
    weights, MoE experts) are not included."""
    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch not in BLOCK_ARCHITECTURES:
        # NOTE: "Llama-architecture" here means Llama's linears and tensor names
        raise ValueError(
            f"{path}: GGUF blocks are read for Llama-architecture files only, this one is "
            f"{arch!r} (read: {', '.join(BLOCK_ARCHITECTURES)}); quant_policy=None or 'float' "
            "computes on its float32 expansion instead"
        )
    permuted = BLOCK_ARCHITECTURES[arch]
    num_heads = gguf_field(reader, f"{arch}.attention.head_count")
    num_kv_heads = gguf_field(reader, f"{arch}.attention.head_count_kv") or num_heads
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
        if permuted and name.endswith("q_proj.weight"):
            blocks = _unpermute_rows(blocks, num_heads)
        elif permuted and name.endswith("k_proj.weight"):
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
