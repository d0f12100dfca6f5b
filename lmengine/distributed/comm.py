"""The tensor-parallel group of this process: its rank, size, and the three collectives the
sharded model needs (all-reduce, gather of vocabulary shards to rank 0, broadcast).

One group per process (torch.distributed's default group). Rank 0 is the engine process;
ranks 1..N-1 are workers. With one rank every collective is the identity, so sharded modules
run unchanged in a single process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    device: torch.device  # where this rank's weights, KV cache and collectives live


_GROUP = TPGroup(0, 1, torch.device("cpu"))


def get_tp_group() -> TPGroup:
    return _GROUP


def set_tp_group(group: TPGroup) -> None:
    global _GROUP
    _GROUP = group


def reset_tp_group() -> None:
    set_tp_group(TPGroup(0, 1, torch.device("cpu")))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the sum."""
    if _GROUP.world_size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of `x` over the ranks, in place."""
    if _GROUP.world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def gather_vocab(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_per_rank] on every rank -> [rows, vocab_size] on rank 0.

    Other ranks get their own shard back (they do not sample). Shards are equal-sized; the
    padding of the last one is cut off.
    """
    if _GROUP.world_size == 1:
        return local[:, :vocab_size]
    local = local.contiguous()
    if _GROUP.rank != 0:
        dist.gather(local, None, dst=0)
        return local
    parts = [torch.empty_like(local) for _ in range(_GROUP.world_size)]
    dist.gather(local, parts, dst=0)
    return torch.cat(parts, dim=-1)[:, :vocab_size]  # [rows, vocab]


def all_reduce_min(value: int) -> int:
    """The minimum of an integer over the ranks (the KV block count every rank can hold)."""
    if _GROUP.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_GROUP.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
