"""Beam search: the k beams of a request are k scheduler Sequences sharing KV blocks.

A `BeamGroup` holds one request's running beams, their scores and its finished hypotheses,
and selects the next beams exactly as transformers' `generate(num_beams=k)` (v5
`_beam_search`): the top `max(2, 1 + num_eos) * k` continuations over beams x vocab of the
processed log-softmax plus the running scores; those that end (EOS or the length limit) and
rank among the first k become hypotheses scored `logprob / generated_len ** length_penalty`;
the best k that do not end run on; `early_stopping` decides when the group is done.

KV: the prompt is prefilled once, by beam 0 (all k beams of the first round stand for that
one sequence, as transformers' first round only draws from beam 0). When beams are selected,
a parent's first child takes over the parent's Sequence; every other child is forked by the
Scheduler (`Scheduler.fork`: the parent's full blocks by reference, a copy of its partial last
block, or a start from scratch when the parent's KV is not on the device or no block is free).
A parent without children is freed. A beam preempted by recompute or swap only delays its
group: the others wait, parked with their rows kept, until it has computed its last token
again. BeamSearch changes sequences and blocks only through the Scheduler's methods.

Streaming: a beam request publishes one Response, when the group is done (the best
hypothesis; `beam_token_ids` and `beam_scores` hold the `num_return_sequences` best; the
output stage builds it, lmengine/engine/output_stage.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from lmengine.scheduler.scheduler import Scheduler
from lmengine.scheduler.sequence import Sequence, SequenceStatus

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(eq=False)
class BeamGroup:
    """One beam-search request: running beams (Sequences), scores, finished hypotheses.

    Tensors are [1, k] or [1, 2k]: the batch dimension of transformers' code, kept so the
    arithmetic (and its rounding and tie-breaking) is the same."""

    request_id: int
    beams: list[Sequence]  # running beams in score order; one sequence before the first round
    eos_token_ids: list[int]
    max_length: int  # prompt + generated tokens at most
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    prompt_len: int
    running_scores: torch.Tensor = None  # [1, k]
    hyp_tokens: list[list[int] | None] = field(default_factory=list)  # generated ids
    hyp_scores: torch.Tensor = None  # [1, k]
    hyp_done: torch.Tensor = None  # [1, k] bool: slot holds a finished hypothesis
    improvable: torch.Tensor = None  # [1, 1] bool: running beams may still beat the worst
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> this round's row
    cur_len: int = 0
    is_done: bool = False

    def __post_init__(self) -> None:
        k = self.num_beams
        self.running_scores = torch.zeros(1, k)
        self.running_scores[:, 1:] = _NEG
        self.hyp_tokens = [None] * k
        self.hyp_scores = torch.full((1, k), _NEG)
        self.hyp_done = torch.zeros(1, k, dtype=torch.bool)
        self.improvable = torch.ones(1, 1, dtype=torch.bool)
        self.cur_len = self.prompt_len

    @property
    def is_ready(self) -> bool:
        """Every running beam has its row for this round."""
        return all(s.seq_id in self.rows for s in self.beams)

    def select(self) -> tuple[list[int], list[int]]:
        """One round of transformers' beam search over the stored rows. Updates scores and
        hypotheses; returns (parent index into `beams`, token) of the k next running beams."""
        k = self.num_beams
        log_probs = torch.stack([self.rows[s.seq_id] for s in self.beams])  # [beams, vocab]
        self.rows = {}
        dev = log_probs.device
        if self.running_scores.device != dev:  # the state lives where the logits are
            for name in ("running_scores", "hyp_scores", "hyp_done", "improvable"):
                setattr(self, name, getattr(self, name).to(dev))
        vocab = log_probs.shape[-1]
        log_probs = log_probs.expand(k, vocab) if log_probs.shape[0] == 1 else log_probs
        scores = (log_probs + self.running_scores[0, :, None]).reshape(1, -1)  # [1, k * vocab]
        num_keep = max(2, 1 + len(self.eos_token_ids)) * k
        top_scores, top_ids = torch.topk(scores, k=num_keep)  # [1, 2k]
        parents, tokens = top_ids // vocab, top_ids % vocab
        if self.cur_len + 1 >= self.max_length:
            ends = torch.ones_like(tokens, dtype=torch.bool)
        else:
            eos = torch.tensor(self.eos_token_ids, dtype=tokens.dtype, device=dev)
            ends = torch.isin(tokens, eos)
        # the k best continuations that do not end run on
        running = top_scores + ends.to(torch.float32) * _NEG
        next_ids = torch.topk(running, k=k)[1]  # [1, k]
        self.running_scores = torch.take_along_dim(running, next_ids, dim=1)
        # candidates among the first k that end become hypotheses if they rank
        is_top = torch.arange(num_keep, device=dev)[None, :] < k
        just_done = ends & is_top
        cand = top_scores / ((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = torch.all(self.hyp_done, dim=-1, keepdim=True) & (self.early_stopping is True)
        cand += full.to(torch.float32) * _NEG
        cand += (~self.improvable).to(torch.float32) * _NEG
        cand += (~just_done) * _NEG
        merged_scores = torch.cat((self.hyp_scores, cand), dim=1)
        merged_done = torch.cat((self.hyp_done, just_done), dim=1)
        best = torch.topk(merged_scores, k=k)[1]  # [1, k]
        parent_list, token_list = parents[0].tolist(), tokens[0].tolist()
        hyps = []
        for i in best[0].tolist():
            if i < k:
                hyps.append(self.hyp_tokens[i])
            else:
                j = i - k
                hyps.append([*self._generated(parent_list[j]), token_list[j]])
        self.hyp_tokens = hyps
        self.hyp_scores = torch.take_along_dim(merged_scores, best, dim=1)
        self.hyp_done = torch.take_along_dim(merged_done, best, dim=1)
        self.cur_len += 1
        self._update_improvable()
        all_full = bool(torch.all(self.hyp_done)) and self.early_stopping is True
        self.is_done = not (bool(self.improvable.any()) and not all_full and not bool(ends.all()))
        nxt = next_ids[0].tolist()
        return [parent_list[j] for j in nxt], [token_list[j] for j in nxt]

    def _generated(self, parent: int) -> list[int]:
        seq = self.beams[parent if len(self.beams) > 1 else 0]
        return seq.generated_token_ids

    def _update_improvable(self) -> None:
        """transformers' early-stop heuristic: can the best running beam still beat the worst
        finished hypothesis?"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_running = self.running_scores[:, :1] / (best_len**self.length_penalty)
        worst_done = torch.where(
            self.hyp_done, torch.min(self.hyp_scores, dim=1, keepdim=True)[0], _NEG
        )
        self.improvable = self.improvable & torch.any(
            best_running > worst_done, dim=-1, keepdim=True
        )

    def results(self, num: int) -> tuple[list[list[int]], list[float]]:
        """The `num` best hypotheses (generated ids) and their scores, best first."""
        tokens = [t if t is not None else [] for t in self.hyp_tokens[:num]]
        return tokens, self.hyp_scores[0, :num].tolist()


class BeamSearch:
    """The beam arithmetic of the engine's beam requests: takes each step's beam rows, runs a
    round for every group whose beams all have theirs, and asks the Scheduler to fork,
    extend, park, requeue and free the beams' Sequences. Holds no groups: each lives in its
    request's record (`RequestRecord.beams`). Runs on the engine loop thread."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: list[int], seq_ids: Iterator[int]):
        self.scheduler = scheduler
        self.eos_token_ids = list(eos_token_ids)
        self.seq_ids = seq_ids
        self.peak_blocks_in_use = 0  # device blocks in use (all requests) after a beam round

    def new_group(self, seq: Sequence) -> BeamGroup:
        """The group of a new beam request, whose one sequence so far is `seq`."""
        cfg = seq.gen_config
        eos = list(cfg.stop_token_ids or [])
        if not cfg.ignore_eos:
            eos = [*self.eos_token_ids, *eos]
        return BeamGroup(
            request_id=seq.request_id,
            beams=[seq],
            eos_token_ids=list(dict.fromkeys(eos)),
            max_length=seq.max_num_tokens,
            num_beams=cfg.num_beams,
            length_penalty=float(cfg.length_penalty),
            early_stopping=cfg.early_stopping,
            prompt_len=seq.num_tokens,
        )

    # ---- each step ------------------------------------------------------------------------------
    def advance(
        self, beam_rows: dict[int, torch.Tensor], groups: Iterable[BeamGroup]
    ) -> list[BeamGroup]:
        """Store this step's rows (by seq_id) in their `groups` (every live beam request's),
        run a round for each group that has all of them; returns the groups that are done
        (their beams still live: the engine's teardown frees them)."""
        groups = list(groups)
        if not groups:
            return []
        group_of = {seq.seq_id: group for group in groups for seq in group.beams}
        done = []
        touched = {}
        for seq_id, row in beam_rows.items():
            group = group_of.get(seq_id)
            if group is not None:
                group.rows[seq_id] = row
                touched[id(group)] = group
        for group in touched.values():
            if group.is_ready:
                parents, tokens = group.select()
                if group.is_done:
                    done.append(group)
                else:
                    self._advance(group, parents, tokens)
            else:  # the beams with their row in wait for the others, holding no claim
                for seq in group.beams:
                    self.scheduler.park(seq, seq.seq_id in group.rows)
        self._unblock_swapped(groups)
        device = self.scheduler.block_manager.device
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, device.num_blocks - device.num_free)
        return done

    def _advance(self, group: BeamGroup, parents: list[int], tokens: list[int]) -> None:
        """Make the k selected (parent, token) pairs the running beams: first child of a
        parent takes it over, the others fork; parents without children are freed."""
        sched = self.scheduler
        old = group.beams
        parent_seqs = [old[p] if len(old) > 1 else old[0] for p in parents]
        owners: set[int] = set()
        new_beams: list[Sequence | None] = []
        for parent in parent_seqs:
            if parent.seq_id in owners:
                new_beams.append(None)  # forked below, before the owner appends its token
            else:
                owners.add(parent.seq_id)
                new_beams.append(parent)
        for j, parent in enumerate(parent_seqs):
            if new_beams[j] is None:
                new_beams[j] = sched.fork(parent, tokens[j], next(self.seq_ids))
        for seq in old:
            if seq.seq_id not in owners:
                sched.remove_sequence(seq)
        for j, seq in enumerate(new_beams):
            if seq is parent_seqs[j]:  # an owner: continues in place
                sched.append_token(seq, tokens[j])
        group.beams = new_beams
        for seq in new_beams:
            sched.park(seq, False)  # a new round: every beam computes its next token

    def _unblock_swapped(self, groups: list[BeamGroup]) -> None:
        """A swapped beam that already has its row has nothing to compute, and the scheduler
        would stop admitting behind it (maybe behind its own group): recompute it instead."""
        for group in groups:
            for seq in group.beams:
                if seq.status == SequenceStatus.SWAPPED and seq.seq_id in group.rows:
                    self.scheduler.requeue(seq)
