"""Tensor parallelism launched by torchrun, as users launch distributed PyTorch programs:

    torchrun --nproc-per-node 2 -m lmengine serve MODEL --tp 2
    torchrun --nnodes 2 --node-rank R --nproc-per-node 2 --master-addr HOST --master-port P \\
        -m lmengine serve MODEL --tp 4          # the same command on both machines

Global rank 0 runs the command: its engine hosts the engine's own rendezvous store on a free
port (torchrun's store already holds MASTER_PORT) and starts no local workers; it writes how
to reach it (model folder, engine settings, address, port) into torchrun's store. Every other
rank, instead of running the command, reads that and becomes one of its workers
(`run_worker`). The world size must equal `tp`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch.distributed as dist

RANK0_KEY = "lmengine/tp/rank0"


def torchrun_rank() -> int | None:
    """This process's global rank when torchrun started it with more than one process."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", 1)) < 2:
        return None
    return int(os.environ["RANK"])


def check_world_size(tp: int) -> None:
    """Rank 0, before loading anything: torchrun's processes are the engine's ranks."""
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise ValueError(f"torchrun started {world} processes: give --tp {world} (got --tp {tp})")


def _torchrun_store(timeout) -> dist.TCPStore:
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(addr, port, is_master=False, timeout=timeout)


def publish_rank0(model_path: str, cfg, device_type: str, port: int) -> None:
    """Rank 0: tell the torchrun ranks how to join its engine (`cfg`: its EngineConfig)."""
    from lmengine.distributed.worker import STORE_TIMEOUT

    check_world_size(cfg.tp)
    cfg_json = json.dumps(dataclasses.asdict(cfg))
    info = dict(model=model_path, cfg=cfg_json, device=device_type, port=port)
    _torchrun_store(STORE_TIMEOUT).set(RANK0_KEY, json.dumps(info))


def run_torchrun_worker(rank: int) -> int:
    """Ranks 1..N-1: wait for rank 0's engine, then serve it as a worker until it stops."""
    from lmengine.config import EngineConfig
    from lmengine.distributed.worker import STORE_TIMEOUT, run_worker

    store = _torchrun_store(STORE_TIMEOUT)
    store.wait([RANK0_KEY])
    info = json.loads(store.get(RANK0_KEY))
    cfg = EngineConfig(**json.loads(info["cfg"]))
    addr = os.environ["MASTER_ADDR"]
    return run_worker(rank, info["model"], cfg, info["device"], addr, info["port"])
