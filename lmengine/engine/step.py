"""The step contract: what one step runs (`StepInput`) and what it returns (`ModelOutput`).

The Scheduler decides a step (`SchedulerOutput`); `StepInput.from_output` turns that decision
into plain values: per sequence, the tokens to compute, where they go in the KV cache and how
to sample after them; the blocks to copy and swap; the LoRA plan. That is everything the
ModelAgent reads, and (without the sampling fields, see `for_workers`) everything each
tensor-parallel rank receives. The ModelAgent answers with one `ModelOutput`: per sequence its
new tokens, their logprobs and draft counts, and the beam-search rows.

Both are plain dataclasses of ints, lists and (in ModelOutput) tensors: picklable, with no
reference to a scheduler object, so a step can cross a process boundary as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmengine.scheduler.sequence import TokenCounts

if TYPE_CHECKING:
    import torch

    from lmengine.scheduler.adapter_manager import AdapterPlan
    from lmengine.scheduler.scheduler import SchedulerOutput


@dataclass(eq=False)
class SeqInput(TokenCounts):
    """One sequence's share of a step.

    The model computes `input_ids` at positions `start_pos, start_pos + 1, ...`, writing their
    KV into the slots of `block_table`. With speculative decoding the last `num_drafts` of
    `input_ids` are draft tokens (added on rank 0 before the forward) and the step returns
    logits at the chunk's last token and at every draft."""

    seq_id: int
    start_pos: int  # tokens already in the cache = position of input_ids[0]
    input_ids: list[int]  # this step's chunk of the sequence, then its drafts
    block_table: list[int]  # device block ids of the sequence, in order
    needs_sample: bool  # the chunk reaches the sequence's last token: sample after it
    adapter_id: int | None = None  # LoRA adapter (AdapterManager id)
    num_lookahead: int = 0  # draft slots the scheduler allocated past the chunk
    num_drafts: int = 0  # trailing input_ids that are drafts
    # ---- research hooks (every rank: they shape the forward; see engine/research.py) -------
    # input_ids [prompt_logits_offset, + num_prompt_logits) get logits scoring the next token
    num_prompt_logits: int = 0
    prompt_logits_offset: int = 0
    hidden_layers: tuple[int, ...] = ()  # layers whose rows of this step are copied out
    steering: tuple = ()  # (layer, scaled vector [hidden], first position steered)
    # ---- rank 0 only (sampling); `StepInput.for_workers` leaves them out -------------------
    gen_config: Any = None  # the request's GenerationConfig
    token_ids: list[int] = field(default_factory=list)  # prompt then generated tokens so far
    num_prompt_tokens: int = 0
    grammar: Any = None  # structured outputs: the request's xgrammar CompiledGrammar

    @property
    def num_new_tokens(self) -> int:
        """Tokens of the sequence computed this step (drafts not counted)."""
        return len(self.input_ids) - self.num_drafts

    @property
    def num_logits(self) -> int:
        """Rows of logits this sequence gets: its last token's and one per draft, or none."""
        return 1 + self.num_drafts if self.needs_sample else 0


@dataclass
class StepInput:
    """Everything the model side needs for one step, as plain values."""

    seqs: list[SeqInput] = field(default_factory=list)  # the packed batch, in order
    # NOTE: applied in this order, before the forward: copies, then swap-outs, then swap-ins.
    # A copy reads blocks as the previous step left them (a fork's partial block), and a
    # swap-out saves a block before a swap-in may reuse it.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    adapter_plan: AdapterPlan | None = None  # LoRA loads, page tables of scheduled adapters
    # sequences that ended since the last step: per-sequence state beside the model (seeded
    # generators, a draft model's progress) can go
    finished_seq_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> StepInput:
        seqs = []
        for item in out.scheduled:
            seq = item.seq
            start = item.start_pos
            seq_input = SeqInput(
                seq_id=seq.seq_id,
                start_pos=start,
                input_ids=seq.token_ids[start : start + item.num_new_tokens],
                block_table=seq.block_table,
                needs_sample=item.needs_sample,
                adapter_id=seq.adapter_id,
                num_lookahead=item.num_lookahead,
                gen_config=seq.gen_config,
                token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens,
                grammar=seq.grammar,
            )
            spec = seq.research  # ResearchSpec or None
            if spec is not None:
                if spec.prompt_logprobs is not None:
                    # row p scores prompt token p + 1, for start <= p + 1 < num_prompt_tokens
                    lo = max(start, max(1, spec.prompt_logprobs_start) - 1)
                    hi = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
                    if hi > lo:
                        seq_input.num_prompt_logits = hi - lo
                        seq_input.prompt_logits_offset = lo - start
                end = start + item.num_new_tokens
                seq_input.hidden_layers = spec.step_layers(start, end, seq.num_prompt_tokens)
                seq_input.steering = spec.steering
            seqs.append(seq_input)
        return cls(
            seqs=seqs,
            blocks_to_copy=list(out.blocks_to_copy),
            blocks_to_swap_out=list(out.blocks_to_swap_out),
            blocks_to_swap_in=list(out.blocks_to_swap_in),
            adapter_plan=out.adapter_plan,
            finished_seq_ids=list(out.finished_seq_ids),
        )

    @property
    def has_block_ops(self) -> bool:
        return bool(self.blocks_to_copy or self.blocks_to_swap_out or self.blocks_to_swap_in)

    @property
    def is_noop(self) -> bool:
        """Nothing for the model side to do: no sequence, no block to move, no adapter to
        load or drop."""
        plan = self.adapter_plan
        has_adapter_work = plan is not None and bool(plan.loads or plan.drops)
        return not (self.seqs or self.has_block_ops or has_adapter_work)

    def for_workers(self) -> StepInput:
        """The part every tensor-parallel rank needs: the sampling fields (request options,
        token histories) stay on rank 0."""
        seqs = [
            dataclasses.replace(s, gen_config=None, token_ids=[], num_prompt_tokens=0, grammar=None)
            for s in self.seqs
        ]
        return dataclasses.replace(self, seqs=seqs, finished_seq_ids=[])


@dataclass
class SequenceOutput:
    """One sequence's result of a step."""

    token_ids: list[int]  # new tokens: one, or (speculative decoding) accepted drafts + one
    # per new token, when the request asked for logprobs: {token_id: logprob} holding the
    # chosen token and the top-N alternatives, from the model's raw distribution
    logprobs: list[dict[int, float]] | None = None
    num_draft_tokens: int = 0  # drafts proposed for this sequence this step
    num_accepted_tokens: int = 0  # of which the model kept
    error: str | None = None  # the request's own code failed (a logits processor): it ends


@dataclass
class ModelOutput:
    """What one step computed, keyed by seq_id."""

    sequences: dict[int, SequenceOutput] = field(default_factory=dict)  # sequences that sampled
    # beam search: per beam sequence its processed log-prob row [vocab] (float32, on the
    # model's device); the BeamSearch picks the next tokens from all beams of a group together
    beam_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # research hooks, for every sequence that asked (sampling this step or not):
    # prompt scoring: (index of the first prompt token scored, {token_id: logprob} per token)
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # hidden states: layer -> rows [num_rows, hidden] of the step's input_ids, from start_pos
    hidden_states: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
