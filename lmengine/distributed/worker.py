"""A tensor-parallel worker: ranks 1..N-1. `python -m lmengine.distributed.worker --help`.

The engine starts these itself (one process per rank, on this machine). For ranks on other
machines, start them there with the same model folder and engine settings, one process per
rank, by hand (`--rank`) or with torchrun (rank = `--rank-offset` + its `LOCAL_RANK`); they
reach rank 0 at `--master-addr`:`--master-port` (the engine's MASTER_ADDR and MASTER_PORT).
Simpler with torchrun: launch the `lmengine` command itself on every rank
(`torchrun ... -m lmengine serve MODEL --tp N`, see `lmengine/distributed/launch.py`).

A worker loads its shard, reports "ok" (or its error) in the rendezvous store, joins the
process group, agrees on the KV block count, then loops: receive a step's inputs, run the
same forward as rank 0. It leaves when rank 0 says stop, when rank 0 goes away, or on error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from lmengine.config import EngineConfig
from lmengine.distributed.comm import TPGroup, backend_for, set_tp_group
from lmengine.distributed.load import load_shard, weight_bytes
from lmengine.distributed.lora import TPLoRAPool
from lmengine.distributed.step import StepChannel, build_rank_cache
from lmengine.engine.malloc import keep_freed_memory
from lmengine.engine.runner import ModelRunner

STATUS_KEY = "lmengine/tp/status/{rank}"
# NOTE: an idle engine sends nothing for as long as it is idle, so collectives must not time
# out; a dead peer is detected by its closed connection (gloo) or by the engine's monitor.
COLLECTIVE_TIMEOUT = timedelta(days=7)
STORE_TIMEOUT = timedelta(seconds=float(os.environ.get("LMENGINE_TP_START_TIMEOUT", 600)))
FAULT_ENV = "LMENGINE_TP_FAULT"  # fault injection for tests: "start:<rank>" fails that rank


def worker_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def set_cpu_threads(cfg: EngineConfig) -> None:
    """Ranks on one CPU share its cores (and keep their freed memory: engine/malloc.py)."""
    torch.set_num_threads(cfg.num_threads or max(1, (os.cpu_count() or 1) // cfg.tp))
    keep_freed_memory()


def _exit_with_parent(parent_pid: int) -> None:
    """A locally started worker never outlives the engine process."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="lmengine-tp-parent-watch").start()


def run_worker(
    rank: int, model_path: str, cfg: EngineConfig, device_type: str, addr: str, port: int
) -> int:
    store = dist.TCPStore(addr, port, cfg.tp, is_master=False, timeout=STORE_TIMEOUT)
    key = STATUS_KEY.format(rank=rank)
    try:
        if os.environ.get(FAULT_ENV) == f"start:{rank}":
            raise RuntimeError(f"injected start failure ({FAULT_ENV})")
        device = worker_device(device_type, rank)
        if device.type == "cpu":
            set_cpu_threads(cfg)
        model, info = load_shard(model_path, cfg.dtype, device, rank, cfg.tp, cfg.trust_remote_code)
    except BaseException as e:
        store.set(key, "error " + "".join(traceback.format_exception_only(e)).strip())
        raise
    store.set(key, f"ok {weight_bytes(model)}")
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=cfg.tp, timeout=COLLECTIVE_TIMEOUT
    )
    set_tp_group(TPGroup(rank, cfg.tp, device))
    cache = build_rank_cache(model, info, cfg, device)
    runner = ModelRunner(model, cache, TPLoRAPool(model, device), device)
    channel = StepChannel(device)
    while (inputs := channel.receive()) is not None:
        if isinstance(inputs, dict):  # NOTE: a LoRA control message (add an adapter)
            runner.lora.control(inputs)
        else:
            runner.run(inputs)
    dist.destroy_process_group()
    return 0


def worker_command(
    rank: int, model_path: str, cfg: EngineConfig, device_type: str, addr: str, port: int
) -> list[str]:
    """The command line that starts rank `rank` on this machine."""
    return [
        sys.executable,
        "-m",
        "lmengine.distributed.worker",
        "--rank",
        str(rank),
        "--model",
        model_path,
        "--engine-config",
        json.dumps(dataclasses.asdict(cfg)),
        "--device",
        device_type,
        "--master-addr",
        addr,
        "--master-port",
        str(port),
        "--parent-pid",
        str(os.getpid()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmengine.distributed.worker",
        allow_abbrev=False,
        description="A tensor-parallel worker rank of an lmengine engine (rank 0).",
    )
    parser.add_argument("--model", required=True, help="the checkpoint folder rank 0 loads")
    parser.add_argument(
        "--engine-config", default="{}", help="EngineConfig fields as JSON (tp at least)"
    )
    parser.add_argument("--rank", type=int, default=None, help="default: offset + $LOCAL_RANK")
    parser.add_argument(
        "--rank-offset", type=int, default=0, help="with torchrun: the first rank of this node"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    parser.add_argument("--master-port", type=int, default=os.environ.get("MASTER_PORT"))
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    if args.rank is None and "LOCAL_RANK" not in os.environ:
        parser.error("--rank is required outside torchrun")
    rank = args.rank if args.rank is not None else args.rank_offset + int(os.environ["LOCAL_RANK"])
    cfg = EngineConfig(**json.loads(args.engine_config))
    if args.master_port is None:
        parser.error("--master-port (or MASTER_PORT) is required")
    if not 0 < rank < cfg.tp:
        parser.error(f"rank {rank} is not a worker rank of tp={cfg.tp} (1..{cfg.tp - 1})")
    device_type = args.device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    return run_worker(rank, args.model, cfg, device_type, args.master_addr, args.master_port)


if __name__ == "__main__":
    sys.exit(main())
