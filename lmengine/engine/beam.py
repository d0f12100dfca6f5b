"""Beam search: the k beams of a request are k scheduler Sequences sharing KV blocks.

A `BeamGroup` holds one request's running beams, their scores and its finished hypotheses,
and selects the next beams exactly as transformers' `generate(num_beams=k)` (v5
`_beam_search`): the top `max(2, 1 + num_eos) * k` continuations over beams x vocab of the
processed log-softmax plus the running scores; those that end (EOS or the length limit) and
rank among the first k become hypotheses scored `logprob / generated_len ** length_penalty`;
the best k that do not end run on; `early_stopping` decides when the group is done.

KV: the prompt is prefilled once, by beam 0 (all k beams of the first round stand for that
one sequence, as transformers' first round only draws from beam 0). When beams are selected,
a parent's first child takes over the parent's Sequence; every other child forks: it takes
the parent's full blocks by reference and a copy of its partial last block (copy-on-write,
emitted as `SchedulerOutput.blocks_to_copy` of the next step). A parent without children is
freed. A beam preempted by recompute or swap only delays its group: the others wait, their
rows kept, until it has computed its last token again. A fork that finds no free block, or a
parent that is not on the device, starts its child from scratch (recompute).

Streaming: a beam request publishes one Response, when the group is done (the best
hypothesis; `beam_token_ids` and `beam_scores` hold the `num_return_sequences` best).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from lmengine.engine.detokenize import IncrementalDetokenizer
from lmengine.engine.request import AddRequest, RequestError, Response
from lmengine.scheduler.scheduler import Scheduler, SchedulerOutput
from lmengine.scheduler.sequence import Sequence, SequenceStatus

_NEG = -1.0e9  # transformers' "impossible" score


def is_beam(seq: Sequence) -> bool:
    return getattr(seq.gen_config, "num_beams", 1) > 1


def split_beam_rows(
    logits: torch.Tensor, seqs: list[Sequence], sampler
) -> tuple[dict[int, torch.Tensor], torch.Tensor, list[Sequence]]:
    """Take the beam-search rows out of a step's logits ([num_samples, vocab], row i for
    seqs[i]). Returns (seq_id -> processed log-prob row [vocab], the other rows, their seqs).

    As transformers: log-softmax in float32, then the logits processors (repetition penalty,
    no-repeat-ngram, min-new-tokens; the Sampler's own, in the same order) on the log-probs."""
    rows = [i for i, s in enumerate(seqs) if is_beam(s)]
    if not rows:
        return {}, logits, seqs
    beam_seqs = [seqs[i] for i in rows]
    log_probs = logits[rows].float().log_softmax(-1)  # [num_beam_rows, vocab]
    log_probs = sampler._apply_penalties(log_probs, beam_seqs)
    log_probs.masked_fill_(log_probs.isnan(), float("-inf"))  # 0 * -inf under extreme penalties
    by_seq = {s.seq_id: log_probs[j] for j, s in enumerate(beam_seqs)}
    taken = set(rows)
    keep = [i for i in range(len(seqs)) if i not in taken]
    return by_seq, logits[keep], [seqs[i] for i in keep]


def validate_beam_request(
    req: AddRequest,
    num_blocks: int,
    block_size: int,
    session_len: int,
    max_batch_size: int,
    is_speculative: bool = False,
) -> None:
    """Refuse a beam request whose k beams could not run side by side, in the batch or in the
    KV pool (the group could then wait for itself forever); RequestError names the numbers."""
    cfg = req.gen_config
    if cfg.num_beams == 1:
        return
    if is_speculative:
        raise RequestError(
            f"num_beams={cfg.num_beams}: beam search is not supported with speculative decoding"
        )
    if cfg.num_beams > max_batch_size:
        raise RequestError(
            f"num_beams={cfg.num_beams} is more than max_batch_size={max_batch_size}"
        )
    max_len = min(len(req.input_ids) + cfg.max_new_tokens, session_len)
    need = cfg.num_beams * -(-max_len // block_size)
    if need > num_blocks:
        raise RequestError(
            f"num_beams={cfg.num_beams} with up to {max_len} tokens per beam may need {need} KV "
            f"blocks, the pool has {num_blocks}: lower num_beams or max_new_tokens"
        )


@dataclass(eq=False)
class BeamGroup:
    """One beam-search request: running beams (Sequences), scores, finished hypotheses.

    Tensors are [1, k] or [1, 2k]: the batch dimension of transformers' code, kept so the
    arithmetic (and its rounding and tie-breaking) is the same."""

    session_id: int
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
    """The engine's beam groups: takes each step's beam rows, runs a round for every group
    whose beams all have theirs, forks and frees Sequences in the Scheduler, and emits the
    copy-on-write block copies into the next SchedulerOutput. Runs on the engine loop thread."""

    def __init__(
        self, scheduler: Scheduler, eos_token_ids: list[int], seq_ids: Iterator[int], tokenizer
    ) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = list(eos_token_ids)
        self.seq_ids = seq_ids
        self.tokenizer = tokenizer
        self.groups: dict[int, BeamGroup] = {}  # session_id -> group
        self.group_of: dict[int, BeamGroup] = {}  # seq_id of a running beam -> its group
        self._copies: list[tuple[int, int, Sequence]] = []  # (src, dst, child) for next step
        self.num_forks = 0  # beams forked from another beam
        self.num_shared_blocks = 0  # full blocks a fork took by reference instead of a copy
        self.num_cow_copies = 0  # partial last blocks copied for a fork
        self.peak_blocks_in_use = 0  # device blocks in use (all requests) after a beam round

    def add(self, seq: Sequence, session_len: int) -> None:
        cfg = seq.gen_config
        eos = list(cfg.stop_token_ids or [])
        if not cfg.ignore_eos:
            eos = [*self.eos_token_ids, *eos]
        self.group_of[seq.seq_id] = self.groups[seq.session_id] = BeamGroup(
            session_id=seq.session_id,
            beams=[seq],
            eos_token_ids=list(dict.fromkeys(eos)),
            max_length=min(seq.num_tokens + cfg.max_new_tokens, session_len),
            num_beams=cfg.num_beams,
            length_penalty=float(cfg.length_penalty),
            early_stopping=cfg.early_stopping,
            prompt_len=seq.num_tokens,
        )

    def abort(self, session_id: int) -> list[Sequence]:
        """Free every beam of the session's group (finished, cancelled, failed)."""
        group = self.groups.pop(session_id, None)
        if group is None:
            return []
        for seq in group.beams:
            self.scheduler.abort_sequence(seq)
            self.group_of.pop(seq.seq_id, None)
        return group.beams

    def best_running(self, session_id: int) -> Sequence | None:
        group = self.groups.get(session_id)
        return group.beams[0] if group is not None else None

    # ---- each step ------------------------------------------------------------------------------
    def before_forward(self, out: SchedulerOutput) -> None:
        """Add last step's fork copies to `out`, for children still holding their block.

        NOTE: a child swapped out by this very schedule would carry the uncopied block to the
        host (swap-outs run before copies): it is sent back to recompute instead."""
        sched = self.scheduler
        for src, dst, child in self._copies:
            if child.status == SequenceStatus.RUNNING and dst in child.block_table:
                out.blocks_to_copy.append((src, dst))
                self.num_cow_copies += 1
            elif child.status == SequenceStatus.SWAPPED and child in out.swapped_out:
                sched.swapped.remove(child)
                sched.block_manager.free(child)
                child.num_computed_tokens = 0
                child.status = SequenceStatus.WAITING
                sched.waiting.append(child)
        self._copies = []

    def after_step(self, beam_rows: dict[int, torch.Tensor]) -> list[tuple[int, BeamGroup]]:
        """Store this step's rows, run a round for each group that has all of them; returns
        (session_id, group) of the groups that are done (their beams still to be freed)."""
        done = []
        if not self.groups:
            return done
        touched = {}
        for seq_id, row in beam_rows.items():
            group = self.group_of.get(seq_id)
            if group is not None:
                group.rows[seq_id] = row
                touched[group.session_id] = group
        for group in touched.values():
            if group.is_ready:
                parents, tokens = group.select()
                if group.is_done:
                    done.append((group.session_id, group))
                else:
                    self._advance(group, parents, tokens)
            else:  # the beams with their row in wait for the others, holding no claim
                for seq in group.beams:
                    seq.parked = seq.seq_id in group.rows
        self._unblock_swapped()
        device = self.scheduler.block_manager.device
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, device.num_blocks - device.num_free)
        return done

    def _advance(self, group: BeamGroup, parents: list[int], tokens: list[int]) -> None:
        """Make the k selected (parent, token) pairs the running beams: first child of a
        parent takes it over, the others fork; parents without children are freed."""
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
                new_beams[j] = self._fork(parent, tokens[j])
        for seq in old:
            if seq.seq_id not in owners:
                self.scheduler.abort_sequence(seq)
                del self.group_of[seq.seq_id]
        for j, seq in enumerate(new_beams):
            if seq is parent_seqs[j]:  # an owner: continues in place
                seq.token_ids.append(tokens[j])
        group.beams = new_beams
        for seq in new_beams:
            seq.parked = False  # a new round: every beam computes its next token
            self.group_of[seq.seq_id] = group

    def _fork(self, parent: Sequence, token: int) -> Sequence:
        """A new beam continuing `parent` with `token` (not yet computed)."""
        sched, bm = self.scheduler, self.scheduler.block_manager
        child = Sequence(
            seq_id=next(self.seq_ids),
            session_id=parent.session_id,
            token_ids=[*parent.token_ids, token],
            gen_config=parent.gen_config,
            priority=parent.priority,
            user_id=parent.user_id,
            adapter_name=parent.adapter_name,
            adapter_id=parent.adapter_id,
            arrival_time=parent.arrival_time,
            num_prompt_tokens=parent.num_prompt_tokens,
            cache_salt=parent.cache_salt,
            num_charged_tokens=parent.num_charged_tokens,
            tenant=parent.tenant,
        )
        self.num_forks += 1
        sched.sessions.setdefault(child.session_id, []).append(child)
        num_computed = parent.num_computed_tokens
        num_full, partial = divmod(num_computed, bm.block_size)
        on_device = parent.status == SequenceStatus.RUNNING and num_computed == parent.num_tokens
        adapters = sched.adapter_manager
        if on_device and bm.device.num_free >= (1 if partial else 0):
            if adapters is None or adapters.acquire(child):
                for block_id in parent.block_table[:num_full]:
                    bm.device.acquire(block_id)
                self.num_shared_blocks += num_full
                child.block_table = parent.block_table[:num_full]
                child.block_keys = parent.block_keys[:num_full]
                if partial:
                    (dst,) = bm.device.allocate(1)
                    self._copies.append((parent.block_table[num_full], dst, child))
                    child.block_table.append(dst)
                child.num_computed_tokens = num_computed
                child.status = SequenceStatus.RUNNING
                sched.running.append(child)
                return child
        child.status = SequenceStatus.WAITING  # recompute from scratch
        sched.waiting.append(child)
        return child

    def _unblock_swapped(self) -> None:
        """A swapped beam that already has its row has nothing to compute, and the scheduler
        would stop admitting behind it (maybe behind its own group): recompute it instead."""
        sched = self.scheduler
        for group in self.groups.values():
            for seq in group.beams:
                if seq.status == SequenceStatus.SWAPPED and seq.seq_id in group.rows:
                    sched.swapped.remove(seq)
                    sched.block_manager.free(seq)
                    seq.num_computed_tokens = 0
                    seq.status = SequenceStatus.WAITING
                    sched.waiting.append(seq)

    # ---- results ------------------------------------------------------------------------------
    def response(self, group: BeamGroup, skip_special_tokens: bool, num: int) -> Response:
        tokens, scores = group.results(num)
        best = tokens[0]
        texts = [self._text(t, group, skip_special_tokens) for t in tokens]
        ends = bool(best) and best[-1] in group.eos_token_ids
        return Response(
            text=texts[0],
            token_ids=best,
            finish_reason="stop" if ends else "length",
            input_token_len=group.prompt_len,
            generate_token_len=len(best),
            beam_token_ids=tokens,
            beam_scores=scores,
            beam_texts=texts if texts[0] is not None else None,
        )

    def _text(self, tokens: list[int], group: BeamGroup, skip: bool) -> str | None:
        if self.tokenizer is None:
            return None
        prompt = group.beams[0].token_ids[: group.prompt_len]
        detok = IncrementalDetokenizer(self.tokenizer, prompt, skip)
        for t in tokens:
            detok.add(t)
        return detok.text
