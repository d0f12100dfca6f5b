"""S-LoRA adapters with tensor parallelism: every rank holds its shard of every adapter.

An adapter's A and B are split like the base linear they attach to (`TPShard`, recorded by
`shard_model`):
- colwise linears (q/k/v, gate/up, each part of a MergedLinear on its own): B's rows follow
  the base's output rows, A stays whole (the input is replicated);
- rowwise linears (o, down): A's columns follow the base's input columns, B stays whole;
  each rank adds `B (A_shard x_shard)` to its partial sum before the all-reduce, so the sum
  over ranks is `B A x`.
The rank r of an adapter is never split, so an adapter needs the same pages on every rank
and the one AdapterManager of rank 0 plans for all of them.

Each rank reads the peft folder itself and keeps only its slices (like the model weights,
which each rank reads from the checkpoint folder): no adapter weights cross the wire. Rank 0
reads first and checks the adapter (its errors go to the caller); then it sends the workers
a small control message ("enable" the pool, "store" the adapter at this path under this id)
on the step channel, between two steps. Each step's AdapterPlan (loads, page tables, drops)
and the adapter of every sequence travel inside the step's StepInput.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmengine.engine.lora_pool import AdapterWeights, LoRAPart, LoRAPool, read_peft_adapter
from lmengine.models.lora import LoRAKind, LoRATargets


def full_targets(targets: LoRATargets) -> LoRATargets:
    """The LoRA targets of the whole model, from those of a shard: what a peft folder holds."""
    kinds = {}
    for name, kind in targets.kinds.items():
        shard = getattr(next(iter(kind.modules.values())), "lmengine_tp_shard", None)
        in_features, sizes = kind.in_features, list(kind.part_sizes)
        if shard is not None and shard.style == "rowwise":
            in_features = shard.full_sizes[0]
        elif shard is not None:
            # one LoRA part over a linear fused in the checkpoint: its whole output
            sizes = [sum(shard.full_sizes)] if len(sizes) == 1 else list(shard.full_sizes)
        kinds[name] = LoRAKind(name, in_features, list(kind.part_names), sizes)
    return LoRATargets(kinds, dict(targets.by_hf_name))


def shard_adapter(weights: AdapterWeights, targets: LoRATargets) -> AdapterWeights:
    """This rank's slices of a whole adapter (copies: the whole tensors can be freed)."""
    out = AdapterWeights(weights.path)
    for kind_name, layers in weights.parts.items():
        kind = targets.kinds[kind_name]
        for layer, parts in layers.items():
            shard = getattr(kind.modules[layer], "lmengine_tp_shard", None)
            sharded = []
            for p in parts:
                a, b = p.lora_a, p.lora_b  # [r, in], [out_part, r]
                if shard is not None and shard.style == "colwise" and len(kind.part_sizes) > 1:
                    start, stop = shard.ranges[p.part]
                    b = b[start:stop]
                elif shard is not None and shard.style == "colwise":
                    # rows of each part of a linear fused in the checkpoint (or its one range)
                    b = torch.cat([b[start:stop] for start, stop in shard.ranges])
                elif shard is not None:
                    start, stop = shard.ranges[0]
                    a = a[:, start:stop]
                sharded.append(
                    LoRAPart(p.part, a.contiguous().clone(), b.contiguous().clone(), p.scale)
                )
            out.parts.setdefault(kind_name, {})[layer] = sharded
    return out


class TPLoRAPool(LoRAPool):
    """One rank's LoRA pool over its model shard. Same interface as LoRAPool; on rank 0,
    `send` forwards `enable` and `store` to the workers, which run them through `control`."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        send: Callable[[dict], None] | None = None,
    ) -> None:
        super().__init__(model, device)
        self.full_targets = full_targets(self.targets)
        self.kind_names = sorted(self.targets.kinds)  # the same on every rank
        self.send = send

    def read(self, path: str) -> AdapterWeights:
        """Read and check the whole adapter against the whole model; keep this rank's shard."""
        return shard_adapter(read_peft_adapter(path, self.full_targets, self.dtype), self.targets)

    def enable(
        self, max_lora_slots: int, max_lora_rank: int, max_cpu_loras: int | None = None
    ) -> dict[str, int]:
        capacity = super().enable(max_lora_slots, max_lora_rank, max_cpu_loras)
        if self.send is not None:
            self.send(
                dict(op="enable", slots=max_lora_slots, rank=max_lora_rank, cpu=max_cpu_loras)
            )
        return capacity

    def store(self, adapter_id: int, weights: AdapterWeights) -> None:
        super().store(adapter_id, weights)
        if self.send is not None:
            self.send(dict(op="store", adapter_id=adapter_id, path=weights.path))

    def control(self, message: dict) -> None:
        """Workers: do what rank 0's pool did."""
        if message["op"] == "enable":
            super().enable(message["slots"], message["rank"], message["cpu"])
        elif message["op"] == "store":
            super().store(message["adapter_id"], self.read(message["path"]))
        else:
            raise ValueError(f"unknown LoRA control message {message!r}")
