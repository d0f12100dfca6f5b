"""The ModelAgent: the model side of a step. StepInput -> one forward -> one ModelOutput.

    execute(inputs):
        forget the state of sequences that ended        (inputs.finished_seq_ids)
        propose drafts, append them to the chunks       (speculative decoding only)
        logits = runner.run(inputs)                     (block moves, LoRA loads, forward)
        score the prompt rows                           (prompt_logprobs requests only)
        sample, verify the drafts or take beam rows     -> ModelOutput

Without tensor parallelism the runner is a local ModelRunner; with it (`TPModelAgent`) the
runner first broadcasts the StepInput to the worker ranks, which run the same ModelRunner.
Everything else (proposing, sampling, verifying) runs here, on rank 0, the same either way.
The agent reads the step's inputs and never touches scheduler state.
"""

from __future__ import annotations

import torch

from lmengine.config import EngineConfig
from lmengine.engine.cache_engine import (
    CacheEngine,
    CacheSpec,
    derive_num_blocks,
    module_tensors,
)
from lmengine.engine.lora_pool import LoRAPool
from lmengine.engine.research import prompt_logprobs
from lmengine.engine.runner import ModelRunner
from lmengine.engine.sampling import Sampler, sequence_output
from lmengine.engine.speculative import Drafts, Proposer, Verifier, build_proposer
from lmengine.engine.step import ModelOutput, SeqInput, StepInput
from lmengine.kernels import cpu_ext
from lmengine.models import patch
from lmengine.models.model_info import ModelInfo
from lmengine.quant import apply_quant_policy


class ModelAgent:
    """Owns the ModelRunner (weights patched in place, KV cache, LoRA pool), the Sampler and,
    with speculative decoding, the proposer and verifier."""

    runner: ModelRunner
    proposer: Proposer | None = None  # speculative decoding: drafts tokens (None when off)
    verifier: Verifier | None = None  # ... and checks them against the model

    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        engine_config: EngineConfig,
        device: torch.device,
    ) -> None:
        cfg = engine_config
        model = apply_quant_policy(patch(model, cfg.module_map), cfg)
        if device.type == "cpu":
            cpu_ext.load()  # NOTE: build the compiled kernels now, not inside the first step
        spec = CacheSpec.for_model(info, cfg, next(model.parameters()).dtype)
        proposer = build_proposer(cfg, info, device)
        # NOTE: a draft model's cache uses the same block ids, so a block costs both caches
        num_blocks = cfg.num_gpu_blocks or derive_num_blocks(
            spec,
            device,
            cfg.cache_max_entry_count,
            *(proposer.cache_specs() if proposer else ()),
            in_use=module_tensors(model),
        )
        if num_blocks < 1:
            raise ValueError("no memory left for even one KV block: lower the model size")
        cache = CacheEngine(spec, num_blocks, cfg.num_cpu_blocks, device, cfg.prefault_kv_cache)
        self._start(ModelRunner(model, cache, LoRAPool(model, device), device), info, proposer)

    def _start(self, runner: ModelRunner, info: ModelInfo, proposer: Proposer | None) -> None:
        """The part shared with TPModelAgent: the runner and everything around it."""
        self.runner = runner
        self.info = info
        self.device = runner.device
        self.sampler = Sampler(info.eos_token_ids, self.device)
        if proposer is not None:
            cache = runner.cache_engine
            proposer.start(cache.num_gpu_blocks, cache.num_cpu_blocks, self.sampler)
            self.proposer = proposer
            self.verifier = Verifier(self.sampler)

    # ---- what the engine reads ---------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def cache_engine(self) -> CacheEngine:
        return self.runner.cache_engine

    @property
    def lora(self) -> LoRAPool:
        return self.runner.lora

    @property
    def num_gpu_blocks(self) -> int:
        return self.cache_engine.num_gpu_blocks

    def speculative_stats(self) -> dict | None:
        """Acceptance statistics over all sequences; None when speculative decoding is off."""
        return self.verifier.stats() if self.verifier is not None else None

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inputs: StepInput) -> ModelOutput:
        for seq_id in inputs.finished_seq_ids:
            self.sampler.release(seq_id)
            if self.proposer is not None:
                self.proposer.release(seq_id)
        if inputs.is_noop:
            return ModelOutput()
        drafts = None
        if self.proposer is not None:
            drafts = self.proposer.propose(inputs)
            for seq, tokens in zip(inputs.seqs, drafts.tokens):
                seq.input_ids = seq.input_ids + tokens
                seq.num_drafts = len(tokens)
        forward = self.runner.run(inputs)
        if forward is None:
            return ModelOutput()
        logits = forward.logits  # [num_logits, vocab]
        scored = {}
        if any(s.num_prompt_logits for s in inputs.seqs):
            logits, scored = prompt_logprobs(logits, inputs.seqs)
        output = self.sample(logits, inputs.seqs, drafts)
        output.prompt_logprobs = scored
        output.hidden_states = forward.hidden_states
        return output

    def sample(
        self, logits: torch.Tensor, seqs: list[SeqInput], drafts: Drafts | None = None
    ) -> ModelOutput:
        """Turn a step's logits into its ModelOutput: verify drafts (speculative decoding),
        take the beam-search rows out, sample the rest in one batch."""
        if drafts is not None:
            return ModelOutput(self.verifier.verify(logits, seqs, drafts))
        sampling = [s for s in seqs if s.needs_sample]
        beam_rows, logits, sampling = self.sampler.split_beam_rows(logits, sampling)
        output = ModelOutput(beam_rows=beam_rows)
        if sampling:
            for seq, res in zip(sampling, self.sampler.sample(logits, sampling)):
                output.sequences[seq.seq_id] = sequence_output([res])
        return output

    def close(self) -> None:
        """Release what outlives the engine loop (tensor-parallel workers); here nothing."""
