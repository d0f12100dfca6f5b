"""One step's inputs on the wire, and the step every rank runs from them.

Rank 0 flattens what the model needs from a SchedulerOutput (tokens, positions, block tables,
swaps) into one int64 tensor behind a 9-integer header that gives its layout, and sends both
with one `broadcast` of a fixed-size buffer: tensors, never pickled objects. Every rank then
builds its StepContext from the same StepInputs with the same code, so the ranks cannot
disagree about a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmengine.config import EngineConfig
from lmengine.distributed.comm import all_reduce_min
from lmengine.distributed.lora import TPLoRAPool
from lmengine.engine.cache_engine import CacheEngine, CacheSpec, derive_num_blocks
from lmengine.models.context import StepContext, build_step_context, step_context
from lmengine.models.model_info import ModelInfo
from lmengine.scheduler.scheduler import SchedulerOutput

CMD_STEP, CMD_STOP, CMD_GROW, CMD_CONTROL = 1, 2, 3, 4
HEADER_SIZE = 9  # cmd, num_swap_in, num_swap_out, num_copy, num_tokens, num_seqs, num_table_ids,
# num_lora, payload size (a control message: cmd, zeros, payload size)


@dataclass
class StepInputs:
    """A SchedulerOutput reduced to plain ids: what every rank needs to run the step."""

    swap_in: list[tuple[int, int]]
    swap_out: list[tuple[int, int]]
    copy: list[tuple[int, int]]
    token_ids: torch.Tensor  # [num_tokens] int64, the packed chunks of every sequence
    start_pos: list[int]  # per sequence: tokens already computed
    q_lens: list[int]  # per sequence: tokens computed this step
    needs_sample: list[bool]  # per sequence
    block_tables: list[list[int]]
    lora: list[int] = field(default_factory=list)  # TPLoRAPool.encode of the step ([]: none)

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> StepInputs:
        items = out.scheduled
        return cls(
            swap_in=list(out.blocks_to_swap_in),
            swap_out=list(out.blocks_to_swap_out),
            copy=list(out.blocks_to_copy),
            token_ids=torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64),
            start_pos=[it.start_pos for it in items],
            q_lens=[it.num_new_tokens for it in items],
            needs_sample=[bool(it.needs_sample) for it in items],
            block_tables=[list(it.block_table) for it in items],
        )

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (header [HEADER_SIZE], payload [n]) int64 tensors."""
        pairs = [x for pairs in (self.swap_in, self.swap_out, self.copy) for p in pairs for x in p]
        table_ids = [b for t in self.block_tables for b in t]
        per_seq = [
            *self.start_pos,
            *self.q_lens,
            *(int(s) for s in self.needs_sample),
            *(len(t) for t in self.block_tables),
        ]
        rest = torch.tensor(pairs + per_seq + table_ids + self.lora, dtype=torch.int64)
        payload = torch.cat([rest[: len(pairs)], self.token_ids, rest[len(pairs) :]])
        header = torch.tensor(
            [
                CMD_STEP,
                len(self.swap_in),
                len(self.swap_out),
                len(self.copy),
                self.token_ids.numel(),
                len(self.q_lens),
                len(table_ids),
                len(self.lora),
                payload.numel(),
            ],
            dtype=torch.int64,
        )
        return header, payload

    @classmethod
    def unpack(cls, header: list[int], payload: torch.Tensor) -> StepInputs:
        _, n_in, n_out, n_copy, n_tokens, n_seqs, n_table, n_lora, _ = header
        payload = payload.cpu()
        pos = 0

        def take(n: int) -> torch.Tensor:
            nonlocal pos
            pos += n
            return payload[pos - n : pos]

        def pairs(n: int) -> list[tuple[int, int]]:
            return [tuple(p) for p in take(2 * n).view(n, 2).tolist()]

        swap_in, swap_out, copy = pairs(n_in), pairs(n_out), pairs(n_copy)
        token_ids = take(n_tokens)
        start_pos = take(n_seqs).tolist()
        q_lens = take(n_seqs).tolist()
        needs_sample = [bool(x) for x in take(n_seqs).tolist()]
        table_ids = payload[pos + n_seqs : pos + n_seqs + n_table].tolist()
        block_tables, at = [], 0
        for n in take(n_seqs).tolist():
            block_tables.append(table_ids[at : at + n])
            at += n
        pos += n_table
        lora = take(n_lora).tolist()
        return cls(
            swap_in, swap_out, copy, token_ids, start_pos, q_lens, needs_sample, block_tables, lora
        )


class StepChannel:
    """Rank 0 -> every rank: one `broadcast` per step of a fixed-size int64 buffer holding
    the header and the payload. A step that does not fit first sends a "grow" header (one
    extra broadcast) and every rank enlarges its buffer; the size then stays."""

    def __init__(self, device: torch.device, capacity: int = 8192) -> None:
        self.device = device
        self.buffer = torch.zeros(HEADER_SIZE + capacity, dtype=torch.int64, device=device)

    def _broadcast(self) -> None:
        dist.broadcast(self.buffer, 0)

    def send(self, inputs: StepInputs | None) -> None:
        """Rank 0: send a step's inputs, or None to stop the workers."""
        if inputs is None:
            self.buffer[0] = CMD_STOP
            self._broadcast()
            return
        header, payload = inputs.pack()
        self._send(torch.cat([header, payload]))  # [HEADER_SIZE + n]

    def send_control(self, message: dict) -> None:
        """Rank 0: a rare control message between steps (JSON as one int64 per byte)."""
        payload = torch.tensor(list(json.dumps(message).encode()), dtype=torch.int64)
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        header[0], header[-1] = CMD_CONTROL, payload.numel()
        self._send(torch.cat([header, payload]))

    def _send(self, message: torch.Tensor) -> None:
        if message.numel() > self.buffer.numel():
            size = max(message.numel(), 2 * self.buffer.numel())
            self.buffer[:2] = torch.tensor([CMD_GROW, size])
            self._broadcast()
            self.buffer = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.buffer[: message.numel()].copy_(message)
        self._broadcast()

    def receive(self) -> StepInputs | dict | None:
        """Other ranks: the next step's inputs, a control message (dict), or None when rank 0
        says stop."""
        while True:
            self._broadcast()
            values = self.buffer.cpu()  # NOTE: one device-to-host copy per step
            cmd = int(values[0])
            if cmd == CMD_STOP:
                return None
            if cmd == CMD_GROW:
                self.buffer = torch.zeros(int(values[1]), dtype=torch.int64, device=self.device)
                continue
            header = values[:HEADER_SIZE].tolist()
            if cmd == CMD_CONTROL:
                data = values[HEADER_SIZE : HEADER_SIZE + header[-1]].tolist()
                return json.loads(bytes(data).decode())
            return StepInputs.unpack(header, values[HEADER_SIZE : HEADER_SIZE + header[-1]])


class RankRunner:
    """One rank's sharded model and KV cache; runs a step from StepInputs (every rank)."""

    def __init__(self, model: torch.nn.Module, cache_engine: CacheEngine, device: torch.device):
        self.model = model
        self.cache_engine = cache_engine
        self.device = device
        self.lora = TPLoRAPool(model, device)  # no tensors until an adapter is added
        spec = cache_engine.spec
        self.block_size = spec.block_size
        self.kv_token_bytes = spec.gather_token_bytes

    def build(self, inputs: StepInputs) -> tuple[torch.Tensor, StepContext]:
        """Pack the scheduled chunks into one token sequence and build the step context."""
        ctx = build_step_context(
            inputs.q_lens,
            inputs.start_pos,
            inputs.block_tables,
            inputs.needs_sample,
            self.block_size,
            self.cache_engine.kv_caches,
            self.device,
            self.kv_token_bytes,
        )
        return inputs.token_ids.to(self.device), ctx

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Swaps, copies, forward. Logits [num_samples, vocab] on rank 0; None when nothing
        runs (other ranks get their own logit shard back, which they ignore)."""
        self.cache_engine.swap_in(inputs.swap_in)
        self.cache_engine.swap_out(inputs.swap_out)
        self.cache_engine.copy(inputs.copy)
        plan = None
        if inputs.lora:
            plan, adapter_ids = self.lora.decode(inputs.lora, len(inputs.q_lens))
            self.lora.apply(plan)
        if not inputs.q_lens:
            return None
        input_ids, ctx = self.build(inputs)
        if plan is not None:
            q_lens = torch.tensor(inputs.q_lens)
            ctx.lora = self.lora.step(adapter_ids, q_lens, plan)
        with step_context(ctx):
            return self.model(input_ids)


def build_rank_runner(
    model: torch.nn.Module, info: ModelInfo, cfg: EngineConfig, device: torch.device
) -> RankRunner:
    """Size this rank's KV cache (its share of the KV heads) and agree on the block count:
    the minimum over the ranks, so every block id the scheduler hands out exists everywhere.
    Collective: every rank calls it once, after the process group is up."""
    num_kv_heads = max(1, info.num_kv_heads // cfg.tp)  # fewer KV heads than ranks: shared
    dtype = next(model.parameters()).dtype
    spec = CacheSpec(
        info.num_layers, num_kv_heads, info.head_dim, cfg.block_size, dtype, cfg.kv_cache_dtype
    )
    num_blocks = cfg.num_gpu_blocks
    if not num_blocks:
        # NOTE: on CPU the ranks share one RAM, so each takes its share of the fraction
        fraction = cfg.cache_max_entry_count / (cfg.tp if device.type == "cpu" else 1)
        num_blocks = derive_num_blocks(spec, device, fraction)
    num_blocks = all_reduce_min(num_blocks)
    if num_blocks < 1:
        raise ValueError("no memory left for even one KV block on some rank")
    return RankRunner(model, CacheEngine(spec, num_blocks, cfg.num_cpu_blocks, device), device)
