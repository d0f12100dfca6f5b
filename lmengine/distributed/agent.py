"""The tensor-parallel ModelAgent: rank 0 of N, in the engine process, plus N-1 workers.

Rank 0 starts the workers, loads its own shard meanwhile, waits until every worker reports
its shard loaded, forms the process group with them, and agrees on the KV block count. It is
a ModelAgent like any other: the same `execute`, sampler and speculative decoding (a draft
model runs whole on rank 0). Only its runner differs: `BroadcastRunner` sends each step's
StepInput to the workers, then runs this rank's shard with the same ModelRunner code.

Failure: a monitor thread watches the workers. If one dies, every worker is stopped, and
`on_failure` (the engine's) fails every request and stops the engine; a step that was running
fails with the same clear error instead of waiting on a dead peer. Any failure inside a
broadcast step is fatal (TPWorkerError): the other ranks may be inside a collective.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from lmengine.config import EngineConfig
from lmengine.distributed.comm import TPGroup, backend_for, reset_tp_group, set_tp_group
from lmengine.distributed.launch import publish_rank0, torchrun_rank
from lmengine.distributed.load import load_shard, local_checkpoint, weight_bytes
from lmengine.distributed.lora import TPLoRAPool
from lmengine.distributed.step import StepChannel, build_rank_cache
from lmengine.distributed.worker import (
    COLLECTIVE_TIMEOUT,
    STATUS_KEY,
    STORE_TIMEOUT,
    set_cpu_threads,
    worker_command,
)
from lmengine.engine.cache_engine import CacheEngine
from lmengine.engine.model_agent import ModelAgent
from lmengine.engine.request import FatalEngineError
from lmengine.engine.runner import ForwardOutput, ModelRunner
from lmengine.engine.speculative import build_proposer
from lmengine.engine.step import StepInput

logger = logging.getLogger("lmengine")

LOCAL_RANKS_ENV = "LMENGINE_TP_LOCAL_WORLD_SIZE"  # ranks on this machine (default: all)


class TPWorkerError(FatalEngineError):
    """A tensor-parallel worker failed to start or died, or a broadcast step failed."""


class WorkerGroup:
    """The worker processes of this machine and the rendezvous store (rank 0 hosts it)."""

    def __init__(self, model_path: str, cfg: EngineConfig, device: torch.device) -> None:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        launched = torchrun_rank() is not None  # NOTE: MASTER_PORT is torchrun's own store
        # NOTE: port 0 lets the OS pick a free port at bind time: no probe-then-bind race
        port = 0 if launched else int(os.environ.get("MASTER_PORT", 0))
        self.store = dist.TCPStore(
            addr, port, cfg.tp, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
        )
        self.tp = cfg.tp
        num_local = 1 if launched else int(os.environ.get(LOCAL_RANKS_ENV, cfg.tp))
        if launched:  # the other ranks are torchrun's: tell them where this engine is
            publish_rank0(model_path, cfg, device.type, self.store.port)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so workers import this lmengine
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, min(num_local, cfg.tp)):
            cmd = worker_command(rank, model_path, cfg, device.type, addr, self.store.port)
            self.procs[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self.weight_bytes: dict[int, int] = {}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def dead(self) -> tuple[int, int] | None:
        """(rank, exit code) of a local worker that has exited, else None."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return rank, code
        return None

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker has loaded its shard; raise TPWorkerError if one fails."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.tp))
        while pending:
            for rank in sorted(pending):
                key = STATUS_KEY.format(rank=rank)
                if self.store.check([key]):
                    status = self.store.get(key).decode()
                    if not status.startswith("ok"):
                        raise TPWorkerError(f"tensor-parallel worker rank {rank} failed: {status}")
                    self.weight_bytes[rank] = int(status.split()[1])
                    pending.discard(rank)
            dead = self.dead()
            if dead is not None and dead[0] in pending:
                raise TPWorkerError(
                    f"tensor-parallel worker rank {dead[0]} exited with code {dead[1]} "
                    "while starting (its output above has the cause)"
                )
            if time.monotonic() > deadline:
                raise TPWorkerError(
                    f"tensor-parallel workers {sorted(pending)} not started within {timeout:.0f} s"
                )
            time.sleep(0.05)

    def kill(self, timeout: float = 5.0) -> None:
        """Stop every worker: wait `timeout` for a clean exit, then kill."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class BroadcastRunner(ModelRunner):
    """Rank 0's runner: broadcasts each StepInput (without its sampling fields) to the
    workers, then runs this rank's shard like any ModelRunner."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache_engine: CacheEngine,
        lora: TPLoRAPool,
        device: torch.device,
        channel: StepChannel,
        check: Callable[[], None],
        on_error: Callable[[str], None],
    ) -> None:
        super().__init__(model, cache_engine, lora, device)
        self.channel = channel
        self._check = check  # raises TPWorkerError when a worker is known dead
        self._on_error = on_error  # the workers may be inside a collective: never reuse them

    def run(self, inputs: StepInput) -> ForwardOutput | None:
        self._check()
        try:
            self.channel.send(inputs.for_workers())
            return super().run(inputs)
        except Exception as e:
            time.sleep(0.2)  # NOTE: let the monitor see a dead process and name it
            self._check()
            message = f"tensor-parallel step failed: {type(e).__name__}: {e}"
            self._on_error(message)
            raise TPWorkerError(message) from e


class TPModelAgent(ModelAgent):
    """Rank 0 of a tensor-parallel model: a ModelAgent whose runner broadcasts each step to
    the worker processes, which it starts, watches and stops."""

    def __init__(
        self,
        model_path: str | None,
        engine_config: EngineConfig,
        device: torch.device,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        cfg = engine_config
        from lmengine.engine.loader import resolve_model_path
        from lmengine.quant.w8a8 import read_quant_config

        is_w8a8 = read_quant_config(resolve_model_path(model_path)) is not None
        if cfg.quant_policy == "gguf":
            raise ValueError(
                "tp > 1 with quant_policy='gguf' is not supported yet: the blocks are not "
                "sharded; use tp=1, or the float32 expansion (quant_policy='float') with tp > 1"
            )
        if cfg.quant_policy == "w8a8" and not is_w8a8:
            raise ValueError(
                f"tp > 1 with quant_policy={cfg.quant_policy!r} on a float checkpoint is not "
                "supported: quantize it first (`lmengine quantize w8a8`) and serve that "
                "checkpoint with tp > 1"
            )
        if is_w8a8 and cfg.adapters:
            raise ValueError("LoRA adapters are not supported together with a w8a8 checkpoint")
        if dist.is_initialized():
            raise RuntimeError(
                "a process group already exists in this process: one tensor-parallel engine "
                "per process (close the other engine first)"
            )
        self.tp = cfg.tp
        self._on_failure = on_failure
        self._closing = threading.Event()
        self._failure: str | None = None
        path = local_checkpoint(model_path)
        self._check_before_start(path, cfg, device)
        if device.type == "cpu":
            set_cpu_threads(cfg)
        self.workers = WorkerGroup(path, cfg, device)
        try:
            model, info = load_shard(path, cfg.dtype, device, 0, cfg.tp, cfg.trust_remote_code)
            proposer = build_proposer(cfg, info, device)  # a draft model: whole, on rank 0
            self.workers.wait_ready(STORE_TIMEOUT.total_seconds())
            dist.init_process_group(
                backend_for(device),
                store=self.workers.store,
                rank=0,
                world_size=cfg.tp,
                timeout=COLLECTIVE_TIMEOUT,
            )
            set_tp_group(TPGroup(0, cfg.tp, device))
            sharing = tuple(proposer.cache_specs()) if proposer is not None else ()
            cache = build_rank_cache(model, info, cfg, device, sharing)
            self.channel = StepChannel(device)
            lora = TPLoRAPool(model, device, send=self.channel.send_control)
            runner = BroadcastRunner(
                model, cache, lora, device, self.channel, self._raise_if_failed, self._step_failed
            )
        except BaseException:
            self._shutdown(send_stop=False)
            raise
        self._start(runner, info, proposer)
        self._monitor = threading.Thread(target=self._watch, name="lmengine-tp-watch", daemon=True)
        self._monitor.start()

    @staticmethod
    def _check_before_start(path: str, cfg: EngineConfig, device: torch.device) -> None:
        """Configuration errors surface before any process starts."""
        from transformers import AutoConfig

        from lmengine.distributed.load import check_tp
        from lmengine.models.model_info import ModelInfo

        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        check_tp(ModelInfo.from_hf(config), cfg.tp, device)

    def rank_weight_bytes(self) -> list[int]:
        """Bytes of the weights each rank holds (rank 0 first)."""
        return [weight_bytes(self.runner.model)] + [
            self.workers.weight_bytes[r] for r in range(1, self.tp)
        ]

    # ---- failure and shutdown ---------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        dead = self.workers.dead()
        if dead is not None and self._failure is None:
            self._failure = self._death_message(*dead)
        if self._failure is not None:
            raise TPWorkerError(self._failure)

    def _step_failed(self, message: str) -> None:
        """A broadcast step failed: the workers cannot be trusted to be in step again, so
        close() kills them instead of sending a stop message."""
        self._failure = self._failure or message

    @staticmethod
    def _death_message(rank: int, code: int) -> str:
        return (
            f"tensor-parallel worker rank {rank} died (exit code {code}); the engine cannot "
            "run without it and has shut down"
        )

    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            dead = self.workers.dead()
            if dead is None:
                continue
            if self._closing.is_set():
                return
            self._failure = self._death_message(*dead)
            logger.error(self._failure)
            # NOTE: stop the other workers at once, so no rank waits on the dead one
            for proc in self.workers.procs.values():
                if proc.poll() is None:
                    proc.kill()
            if self._on_failure is not None:
                self._on_failure(self._failure)
            return

    def close(self) -> None:
        """Stop the workers (a clean stop message when they are healthy) and leave the group."""
        if self._closing.is_set():
            return
        self._shutdown(send_stop=self._failure is None and self.workers.dead() is None)

    def _shutdown(self, send_stop: bool) -> None:
        self._closing.set()
        if send_stop and dist.is_initialized():
            try:
                self.channel.send(None)
            except Exception as e:  # a worker died meanwhile: kill() below cleans up
                logger.warning("tensor-parallel stop message failed: %s", e)
        self.workers.kill(timeout=5.0 if send_stop else 0.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:
                logger.warning("destroying the tensor-parallel group failed: %s", e)
        reset_tp_group()
