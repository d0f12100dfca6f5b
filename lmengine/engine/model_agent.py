"""The ModelAgent: patched model, KV cache and sampler. SchedulerOutput -> one forward -> tokens.

It reads the scheduled sequences but never mutates them: the results go back as plain Python
values, and the Engine hands them to the Scheduler.
"""

from __future__ import annotations

import itertools

import torch

from lmengine.config import EngineConfig
from lmengine.engine.beam import split_beam_rows
from lmengine.engine.cache_engine import CacheEngine, CacheSpec, derive_num_blocks
from lmengine.engine.lora_pool import LoRAPool
from lmengine.engine.sampling import Sampler, SampleResult
from lmengine.engine.speculative import DraftModelProposer, Drafts, NgramProposer, Verifier
from lmengine.kernels import cpu_ext
from lmengine.models import patch
from lmengine.models.context import StepContext, build_step_context, step_context
from lmengine.models.model_info import ModelInfo
from lmengine.quant import apply_quant_policy
from lmengine.scheduler.scheduler import SchedulerOutput


class ModelAgent:
    """Owns the weights (patched in place), the CacheEngine and the Sampler."""

    # speculative decoding (None when off): drafts tokens, then the verifier checks them
    proposer: NgramProposer | DraftModelProposer | None = None
    verifier: Verifier | None = None

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
        self.sampler = Sampler(info.eos_token_ids, device)
        speculative = engine_config.speculative
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = load_draft_model(speculative.draft_model, info, engine_config, device)
        # NOTE: a draft model's cache uses the same block ids, so a block costs both caches
        num_gpu_blocks = engine_config.num_gpu_blocks or derive_num_blocks(
            spec, device, engine_config.cache_max_entry_count, *([draft[1]] if draft else [])
        )
        if num_gpu_blocks < 1:
            raise ValueError("no memory left for even one KV block: lower the model size")
        self.cache_engine = CacheEngine(spec, num_gpu_blocks, engine_config.num_cpu_blocks, device)
        self.kv_token_bytes = spec.gather_token_bytes
        self.lora = LoRAPool(self.model, device)  # no tensors until an adapter is added
        if speculative is not None:
            self.verifier = Verifier(self.sampler)
            if draft is None:
                self.proposer = NgramProposer(speculative)
            else:
                draft_model, draft_spec = draft
                self.proposer = DraftModelProposer(
                    draft_model,
                    draft_spec,
                    num_gpu_blocks,
                    engine_config.num_cpu_blocks,
                    self.sampler,
                    device,
                    draft_spec.gather_token_bytes,
                )

    @property
    def num_gpu_blocks(self) -> int:
        return self.cache_engine.num_gpu_blocks

    def prepare(
        self, out: SchedulerOutput, drafts: Drafts | None = None
    ) -> tuple[torch.Tensor, StepContext]:
        """Pack the scheduled chunks (each followed by its draft tokens, if any) into one
        token sequence and build the step context."""
        items = out.scheduled
        extra = drafts.tokens if drafts is not None else [[] for _ in items]
        input_ids = torch.tensor(
            list(itertools.chain.from_iterable(it.token_ids + d for it, d in zip(items, extra)))
        )
        q_lens = [it.num_new_tokens + len(d) for it, d in zip(items, extra)]
        num_logits = None
        if drafts is not None:  # logits at the last token and at every draft
            num_logits = [1 + len(d) if it.needs_sample else 0 for it, d in zip(items, extra)]
        ctx = build_step_context(
            q_lens,
            [it.start_pos for it in items],
            [it.block_table for it in items],
            [it.needs_sample for it in items],
            self.block_size,
            self.cache_engine.kv_caches,
            self.device,
            self.kv_token_bytes,
            num_logits,
        )
        if out.adapter_plan is not None:
            adapter_ids = [it.seq.adapter_id for it in items]
            ctx.lora = self.lora.step(adapter_ids, torch.tensor(q_lens), out.adapter_plan)
        return input_ids.to(self.device), ctx

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> dict[int, SampleResult | list[SampleResult]]:
        """Run one step. Returns `seq_id -> SampleResult` for sequences that sample; with
        speculative decoding, `seq_id -> [SampleResult, ...]`: accepted drafts, then one more.
        The log-prob rows of beam-search sequences go to `self.beam_rows` instead."""
        self.beam_rows: dict[int, torch.Tensor] = {}
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.copy(out.blocks_to_copy)
        if self.proposer is not None:
            self.proposer.mirror(out)
        if out.adapter_plan is not None:
            self.lora.apply(out.adapter_plan)
        if out.is_empty:
            return {}
        drafts = self.proposer.propose(out.scheduled) if self.proposer is not None else None
        input_ids, ctx = self.prepare(out, drafts)
        with step_context(ctx):
            logits = self.model(input_ids)  # [num_samples, vocab]
        if drafts is not None:
            return self.verifier.verify(logits, out.scheduled, drafts)
        seqs = [it.seq for it in out.scheduled if it.needs_sample]
        self.beam_rows, logits, seqs = split_beam_rows(logits, seqs, self.sampler)
        if not seqs:
            return {}
        results = self.sampler.sample(logits, seqs)
        return {seq.seq_id: res for seq, res in zip(seqs, results)}

    def speculative_stats(self, seq_id: int | None = None) -> dict | None:
        """Acceptance statistics: in total, or of one live sequence; None when speculative
        decoding is off."""
        if self.verifier is None:
            return None
        if seq_id is None:
            return self.verifier.stats()
        drafted, accepted = self.verifier.per_sequence.get(seq_id, (0, 0))
        return {"num_draft_tokens": drafted, "num_accepted_tokens": accepted}

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)
        if self.proposer is not None:
            self.proposer.release(seq_id)
            self.verifier.release(seq_id)

    def close(self) -> None:
        """Release what outlives the engine loop (tensor-parallel workers); here nothing."""


def load_draft_model(
    path: str, info: ModelInfo, engine_config: EngineConfig, device: torch.device
) -> tuple[torch.nn.Module, CacheSpec]:
    """Load and patch the speculative draft model; its vocabulary must be the target's."""
    from lmengine.engine.loader import load_model_and_tokenizer

    model, _, _, _ = load_model_and_tokenizer(
        path, engine_config.dtype, str(device.type), engine_config.trust_remote_code
    )
    draft_info = ModelInfo.from_hf(model.config)
    if draft_info.vocab_size != info.vocab_size:
        raise ValueError(
            f"the draft model {path!r} has a vocabulary of {draft_info.vocab_size} tokens, "
            f"the model {info.vocab_size}: a draft model must share the tokenizer"
        )
    model = patch(model, engine_config.module_map)
    dtype = next(model.parameters()).dtype
    spec = CacheSpec(
        draft_info.num_layers,
        draft_info.num_kv_heads,
        draft_info.head_dim,
        engine_config.block_size,
        dtype,
        engine_config.kv_cache_dtype,
    )
    return model, spec
