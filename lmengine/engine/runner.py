"""The ModelRunner: one step's block moves, LoRA loads and forward, the same on every rank.

`run(inputs)` applies the step's block copies and swaps to the KV cache, loads the adapters
the plan names, packs the scheduled chunks into one token sequence with its step context, and
runs the patched model once. Without tensor parallelism the ModelAgent calls it directly;
with it, rank 0 broadcasts the StepInput first and every rank calls the same `run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmengine.engine.cache_engine import CacheEngine
from lmengine.engine.lora_pool import LoRAPool
from lmengine.engine.step import StepInput
from lmengine.models.context import StepContext, build_step_context, step_context
from lmengine.models.hooks import LayerHooks, SeqHooks
from lmengine.models.model_info import ModelInfo


@dataclass
class ForwardOutput:
    """What one forward computed: logits of the asked rows (per sequence its prompt-scoring
    rows, then its sampling rows) and the hidden states the requests asked for."""

    logits: torch.Tensor  # [num_logits, vocab]
    hidden_states: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    """Owns one rank's patched model, its KV cache and its LoRA pool; turns a StepInput into
    logits. Never samples and never reads request options."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache_engine: CacheEngine,
        lora: LoRAPool,
        device: torch.device,
    ) -> None:
        self.model = model
        self.cache_engine = cache_engine
        self.lora = lora
        self.device = device
        self.block_size = cache_engine.spec.block_size
        self.kv_token_bytes = cache_engine.spec.gather_token_bytes
        self.num_layers = ModelInfo.from_hf(model.config).num_layers

    def prepare(self, inputs: StepInput) -> tuple[torch.Tensor, StepContext]:
        """Pack every sequence's `input_ids` into one token sequence [num_tokens] and build
        the step context (positions, KV slots, attention metadata, logits rows, LoRA)."""
        seqs = inputs.seqs
        input_ids = torch.tensor([t for s in seqs for t in s.input_ids])  # [num_tokens]
        q_lens = [len(s.input_ids) for s in seqs]
        has_drafts = any(s.num_drafts for s in seqs)
        has_scoring = any(s.num_prompt_logits for s in seqs)
        ctx = build_step_context(
            q_lens,
            [s.start_pos for s in seqs],
            [s.block_table for s in seqs],
            [s.needs_sample for s in seqs],
            self.block_size,
            self.cache_engine.kv_caches,
            self.device,
            self.kv_token_bytes,
            [s.num_logits for s in seqs] if has_drafts or has_scoring else None,
            [s.num_prompt_logits for s in seqs] if has_scoring else None,
            [s.prompt_logits_offset for s in seqs] if has_scoring else None,
        )
        if any(s.hidden_layers or s.steering for s in seqs):
            ctx.hooks = self._hooks(inputs)
        plan = inputs.adapter_plan
        if plan is not None:
            adapter_ids = [s.adapter_id for s in seqs]
            ctx.lora = self.lora.step(adapter_ids, torch.tensor(q_lens), plan)
        return input_ids.to(self.device), ctx

    def _hooks(self, inputs: StepInput) -> LayerHooks | None:
        asks, row = [], 0
        for s in inputs.seqs:
            n = len(s.input_ids)
            asks.append(SeqHooks(s.seq_id, row, n, s.start_pos, s.hidden_layers, s.steering))
            row += n
        return LayerHooks.build(asks, self.num_layers, self.device)

    @torch.inference_mode()
    def run(self, inputs: StepInput) -> ForwardOutput | None:
        """Block moves, adapter loads, forward. Returns the logits (this rank's shard of them
        with tensor parallelism) and hidden states, None when no sequence runs."""
        self.cache_engine.apply(inputs)
        if inputs.adapter_plan is not None:
            self.lora.apply(inputs.adapter_plan)
        if not inputs.seqs:
            return None
        input_ids, ctx = self.prepare(inputs)
        with step_context(ctx):
            logits = self.model(input_ids)
        hooks = ctx.hooks
        return ForwardOutput(logits, hooks.by_sequence() if hooks is not None else {})
