"""Reading each rank's slices of a checkpoint: `CheckpointReader` reads the pieces of a load
plan (distributed/shard.py) from safetensors files without reading whole files, and
`materialize` puts them into the sharded model in place of its meta parameters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lmengine.distributed.shard import LoadPlan, Piece
from lmengine.models.layers import PackedLinear


class CheckpointReader:
    """Reads slices of tensors from a folder of safetensors files, never whole files."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(
                f"tp > 1 loads each rank's shard from safetensors files; {folder} has none"
            )
        self._handles = {f: safe_open(str(folder / f), framework="pt", device="cpu") for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self.weight_map = weight_map

    def _stacked_experts(self, key: str, start: int = 0, stop: int | None = None):
        """transformers' 3-D expert parameters from the per-expert tensors checkpoints hold:
        `experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and `experts.down_proj`
        [E, H, I], from `experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen3-MoE) or
        `experts.{e}.w1/w3/w2.weight` (Mixtral); experts [start, stop) only. None when `key`
        is neither."""
        prefix, _, name = key.rpartition(".experts.")
        names = {
            "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
            "down_proj": (("down_proj",), ("w2",)),
        }.get(name)
        if not prefix or names is None:
            return None
        for parts in names:
            first = f"{prefix}.experts.0.{parts[0]}.weight"
            if first not in self.weight_map:
                continue
            if stop is None:
                stop = 0
                while f"{prefix}.experts.{stop}.{parts[0]}.weight" in self.weight_map:
                    stop += 1
            experts = [
                torch.cat([self._whole(f"{prefix}.experts.{e}.{p}.weight") for p in parts])
                for e in range(start, stop)
            ]
            return torch.stack(experts)
        return None

    def _whole(self, key: str) -> torch.Tensor:
        return self._handles[self.weight_map[key]].get_slice(key)[:]

    def read(self, piece: Piece, like: torch.Tensor) -> torch.Tensor:
        """The rows of one piece, in `like`'s dtype (on CPU)."""
        if piece.key is None or (piece.missing_is_zero and piece.key not in self.weight_map):
            return torch.zeros(piece.stop - piece.start, *like.shape[1:], dtype=like.dtype)
        if piece.key not in self.weight_map and piece.dim in (None, 0):
            rows = (0, None) if piece.dim is None else (piece.start, piece.stop)
            stacked = self._stacked_experts(piece.key, *rows)
            if stacked is not None:
                return stacked.to(like.dtype)
        if piece.key not in self.weight_map:
            raise ValueError(
                f"tp > 1 is not supported for this checkpoint: tensor {piece.key!r} is not in "
                "it. Sharded loading reads tensors by the model's parameter names, and this "
                "architecture's checkpoint names differ (transformers renames them when it "
                "loads the whole model). Use tp=1."
            )
        sl = self._handles[self.weight_map[piece.key]].get_slice(piece.key)
        if piece.dim is None:
            t = sl[:]
        elif piece.dim == 0:
            t = sl[piece.start : piece.stop]
        else:
            t = sl[:, piece.start : piece.stop]
        t = t.to(like.dtype)
        if piece.pad:
            t = torch.cat([t, t.new_zeros(piece.pad, *t.shape[1:])])
        return t


def materialize(
    model: nn.Module, load: LoadPlan, reader: CheckpointReader, device: torch.device
) -> None:
    """Replace every meta parameter with its slices read from the checkpoint (tied parameters
    stay tied), move buffers to `device` and repack the linears."""
    new: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters():
        pieces = load.get(name)
        if pieces is None:
            raise KeyError(f"no load plan for parameter {name}")
        parts = [reader.read(p, param) for p in pieces]
        t = parts[0] if len(parts) == 1 else torch.cat(parts)
        if tuple(t.shape) != tuple(param.shape):
            raise ValueError(f"{name}: read {tuple(t.shape)}, expected {tuple(param.shape)}")
        new[id(param)] = nn.Parameter(t.to(device), requires_grad=False)
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[pname] = new[id(p)]
    for module_name, module in model.named_modules():  # int8 weights and scales (w8a8)
        for bname, buf in list(module._buffers.items()):
            name = f"{module_name}.{bname}" if module_name else bname
            if buf is None or name not in load:
                continue
            if not buf.is_meta and any(p.key not in reader.weight_map for p in load[name]):
                continue  # a buffer the checkpoint does not hold keeps its initial value
            parts = [reader.read(p, buf) for p in load[name]]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)
            if tuple(t.shape) != tuple(buf.shape):
                raise ValueError(f"{name}: read {tuple(t.shape)}, expected {tuple(buf.shape)}")
            module._buffers[bname] = t.to(device)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"no values loaded for {left[:5]}")
    model.to(device)
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.repack()
