"""The ModelAgent: patched model, KV cache and sampler. SchedulerOutput -> one forward -> tokens.

It reads the scheduled sequences but never mutates them: the results go back as plain Python
values, and the Engine hands them to the Scheduler.
"""

from __future__ import annotations

import itertools

import torch

from lmengine.config import EngineConfig
from lmengine.engine.cache_engine import CacheEngine, CacheSpec, derive_num_blocks
from lmengine.engine.lora_pool import LoRAPool
from lmengine.engine.sampling import Sampler, SampleResult
from lmengine.kernels import cpu_ext
from lmengine.models import patch
from lmengine.models.context import StepContext, build_step_context, step_context
from lmengine.models.model_info import ModelInfo
from lmengine.quant import apply_quant_policy
from lmengine.scheduler.scheduler import SchedulerOutput


class ModelAgent:
    """Owns the weights (patched in place), the CacheEngine and the Sampler."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        engine_config: EngineConfig,
        device: torch.device,
    ) -> None:
        self.model = apply_quant_policy(patch(model, engine_config.module_map), engine_config)
        if device.type == "cpu":
            cpu_ext.load()  # NOTE: build the compiled kernels now, not inside the first step
        self.info = info
        self.device = device
        self.block_size = engine_config.block_size
        dtype = next(model.parameters()).dtype
        spec = CacheSpec(
            info.num_layers,
            info.num_kv_heads,
            info.head_dim,
            self.block_size,
            dtype,
            engine_config.kv_cache_dtype,
        )
        num_gpu_blocks = engine_config.num_gpu_blocks or derive_num_blocks(
            spec, device, engine_config.cache_max_entry_count
        )
        if num_gpu_blocks < 1:
            raise ValueError("no memory left for even one KV block: lower the model size")
        self.cache_engine = CacheEngine(spec, num_gpu_blocks, engine_config.num_cpu_blocks, device)
        self.kv_token_bytes = spec.gather_token_bytes
        self.sampler = Sampler(info.eos_token_ids, device)
        self.lora = LoRAPool(self.model, device)  # no tensors until an adapter is added

    @property
    def num_gpu_blocks(self) -> int:
        return self.cache_engine.num_gpu_blocks

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, StepContext]:
        """Pack the scheduled chunks into one token sequence and build the step context."""
        items = out.scheduled
        input_ids = torch.tensor(list(itertools.chain.from_iterable(it.token_ids for it in items)))
        ctx = build_step_context(
            [it.num_new_tokens for it in items],
            [it.start_pos for it in items],
            [it.block_table for it in items],
            [it.needs_sample for it in items],
            self.block_size,
            self.cache_engine.kv_caches,
            self.device,
            self.kv_token_bytes,
        )
        if out.adapter_plan is not None:
            adapter_ids = [it.seq.adapter_id for it in items]
            q_lens = torch.tensor([it.num_new_tokens for it in items])
            ctx.lora = self.lora.step(adapter_ids, q_lens, out.adapter_plan)
        return input_ids.to(self.device), ctx

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> dict[int, SampleResult]:
        """Run one step. Returns `seq_id -> SampleResult` for sequences that sample."""
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.copy(out.blocks_to_copy)
        if out.adapter_plan is not None:
            self.lora.apply(out.adapter_plan)
        if out.is_empty:
            return {}
        input_ids, ctx = self.prepare(out)
        with step_context(ctx):
            logits = self.model(input_ids)  # [num_samples, vocab]
        seqs = [it.seq for it in out.scheduled if it.needs_sample]
        if not seqs:
            return {}
        results = self.sampler.sample(logits, seqs)
        return {seq.seq_id: res for seq, res in zip(seqs, results)}

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)

    def close(self) -> None:
        """Release what outlives the engine loop (tensor-parallel workers); here nothing."""
