"""One step on the wire: rank 0 sends each step's StepInput to every rank.

The StepInput (lmengine/engine/step.py) is the same plain dataclass the ModelAgent runs
without tensor parallelism, minus its rank-0-only sampling fields (`for_workers`). Rank 0
pickles it into a fixed-size uint8 buffer behind a 2-integer header and sends it with one
`broadcast`; every rank then runs the same ModelRunner on it, so the ranks cannot disagree
about a step. The buffer travels only inside the process group, between processes that rank 0
started (or that joined its rendezvous), as torch.distributed's own object collectives do.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from lmengine.config import EngineConfig
from lmengine.distributed.comm import all_reduce_min
from lmengine.engine.cache_engine import (
    CacheEngine,
    CacheSpec,
    derive_num_blocks,
    module_tensors,
)
from lmengine.engine.step import StepInput
from lmengine.models.model_info import ModelInfo

CMD_STEP, CMD_STOP, CMD_GROW, CMD_CONTROL = 1, 2, 3, 4
HEADER_BYTES = 16  # two int64: the command and the payload size in bytes (GROW: the new size)


class StepChannel:
    """Rank 0 -> every rank: one `broadcast` per step of a fixed-size uint8 buffer holding the
    header and the pickled message. A message that does not fit first sends a "grow" header
    (one extra broadcast) and every rank enlarges its buffer; the size then stays."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.buffer = torch.zeros(HEADER_BYTES + capacity, dtype=torch.uint8, device=device)

    def _broadcast(self) -> None:
        dist.broadcast(self.buffer, 0)

    def send(self, inputs: StepInput | None) -> None:
        """Rank 0: send a step's inputs, or None to stop the workers."""
        if inputs is None:
            self._send(CMD_STOP, b"")
        else:
            self._send(CMD_STEP, pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL))

    def send_control(self, message: dict) -> None:
        """Rank 0: a rare control message between steps (a LoRA pool change)."""
        self._send(CMD_CONTROL, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send(self, cmd: int, payload: bytes) -> None:
        size = HEADER_BYTES + len(payload)
        if size > self.buffer.numel():
            grown = max(size, 2 * self.buffer.numel())
            self._header(CMD_GROW, grown)
            self._broadcast()
            self.buffer = torch.zeros(grown, dtype=torch.uint8, device=self.device)
        self._header(cmd, len(payload))
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self.buffer[HEADER_BYTES:size].copy_(data)
        self._broadcast()

    def _header(self, cmd: int, value: int) -> None:
        header = torch.tensor([cmd, value], dtype=torch.int64).view(torch.uint8)
        self.buffer[:HEADER_BYTES].copy_(header)

    def receive(self) -> StepInput | dict | None:
        """Other ranks: the next step's inputs, a control message (dict), or None when rank 0
        says stop."""
        while True:
            self._broadcast()
            header = self.buffer[:HEADER_BYTES].cpu().view(torch.int64).tolist()
            cmd, value = header
            if cmd == CMD_STOP:
                return None
            if cmd == CMD_GROW:
                self.buffer = torch.zeros(value, dtype=torch.uint8, device=self.device)
                continue
            # NOTE: one device-to-host copy of the message per step
            payload = self.buffer[HEADER_BYTES : HEADER_BYTES + value].cpu().numpy().tobytes()
            return pickle.loads(payload)


def build_rank_cache(
    model: torch.nn.Module,
    info: ModelInfo,
    cfg: EngineConfig,
    device: torch.device,
    sharing: tuple[CacheSpec, ...] = (),
) -> CacheEngine:
    """This rank's KV cache: its share of the KV heads, and the block count agreed on by all
    ranks, the minimum over them, so every block id the scheduler hands out exists
    everywhere. `sharing`: caches on this rank addressed by the same block ids (rank 0's
    speculative draft model). Collective: every rank calls it once, after the process group
    is up."""
    num_kv_heads = max(1, info.num_kv_heads // cfg.tp)  # fewer KV heads than ranks: shared
    spec = CacheSpec.for_model(info, cfg, next(model.parameters()).dtype, num_kv_heads)
    num_blocks = cfg.num_gpu_blocks
    if not num_blocks:
        # NOTE: on CPU the ranks share one RAM, so each takes its share of the fraction
        fraction = cfg.cache_max_entry_count / (cfg.tp if device.type == "cpu" else 1)
        num_blocks = derive_num_blocks(
            spec, device, fraction, *sharing, in_use=module_tensors(model)
        )
    num_blocks = all_reduce_min(num_blocks)
    if num_blocks < 1:
        raise ValueError("no memory left for even one KV block on some rank")
    return CacheEngine(spec, num_blocks, cfg.num_cpu_blocks, device, cfg.prefault_kv_cache)
