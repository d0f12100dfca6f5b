"""Speculative decoding: draft proposers, and the verification that keeps the target exact.

Each step, a decoding sequence that the Scheduler gave lookahead slots
(`SeqInput.num_lookahead`) gets up to that many draft tokens from a proposer. The ModelAgent
appends them to the sequence's chunk in the StepInput and runs the last token and its drafts
as one chunk through the target model, with logits at every position, and `verify` keeps the
longest acceptable prefix of the drafts plus one token drawn after it:

- greedy requests keep drafts while each equals the target's argmax, then add the argmax at
  the first mismatch: the output is the non-speculative greedy output, token for token;
- sampling requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft d
  drawn from q is kept with probability min(1, p(d) / q(d)); on rejection the token is drawn
  from max(0, p - q) renormalised; after all drafts it is drawn from p. Each token is then
  distributed exactly as p, the target's processed distribution (penalties, temperature,
  top-k, top-p, computed as if the earlier drafts had been accepted).

Proposers: `NgramProposer` (prompt lookup: no model; q is a point mass on its draft) and
`DraftModelProposer` (a smaller model with the same vocabulary, over its own paged KV cache
that uses the target's block ids, so the Scheduler's block tables, swaps and copies serve
both). Proposing and verifying run on rank 0; with tensor parallelism the drafts reach the
other ranks inside the StepInput like any other token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmengine.config import EngineConfig, SpeculativeConfig
from lmengine.engine.cache_engine import CacheEngine, CacheSpec
from lmengine.engine.lora_pool import LoRAPool
from lmengine.engine.runner import ModelRunner
from lmengine.engine.sampling import Sampler, greedy, sequence_output
from lmengine.engine.step import SeqInput, SequenceOutput, StepInput
from lmengine.models import patch
from lmengine.models.model_info import ModelInfo
from lmengine.scheduler.sequence import TokenCounts


@dataclass
class Drafts:
    """One step's proposals, aligned with `StepInput.seqs`."""

    tokens: list[list[int]]  # per scheduled item: its draft tokens (empty: none)
    # per item: [len(tokens[i]), vocab] draft distribution for sampling requests, None when
    # the draft is deterministic (a point mass on each draft token)
    probs: list[torch.Tensor | None]


class NgramProposer:
    """Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, trying n from `prompt_lookup_max` down to `prompt_lookup_min`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def cache_specs(self) -> list[CacheSpec]:
        """No KV cache of its own."""
        return []

    def start(self, num_gpu_blocks: int, num_cpu_blocks: int, sampler: Sampler) -> None:
        """Nothing to allocate."""

    def propose(self, inputs: StepInput) -> Drafts:
        tokens = [self.lookup(s.token_ids, s.num_lookahead) for s in inputs.seqs]
        return Drafts(tokens, [None] * len(inputs.seqs))

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        ids = torch.tensor(token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            windows = ids.unfold(0, n, 1)[:-1]  # [L - n, n], every n-gram but the suffix itself
            hits = (windows == ids[-n:]).all(1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return token_ids[start : start + k]
        return []

    def release(self, seq_id: int) -> None:
        """No per-sequence state."""


class DraftModelProposer:
    """A draft model over its own KV cache, addressed by the target's block ids.

    Each step it first applies the step's block copies and swaps to its cache, catches up with
    what the target computes this step (prompt chunks, and the tokens accepted since it last
    ran), then drafts autoregressively, one token per sequence per forward. `computed[seq_id]`
    counts the positions of the sequence whose draft KV is valid; positions the target rewinds
    past are simply recomputed. With tensor parallelism it runs whole on rank 0.
    """

    def __init__(self, model: torch.nn.Module, spec: CacheSpec, device: torch.device) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self.runner: ModelRunner | None = None  # over the draft cache, from `start`
        self.sampler: Sampler | None = None
        self.computed: dict[int, int] = {}

    def cache_specs(self) -> list[CacheSpec]:
        return [self.spec]

    @property
    def cache_engine(self) -> CacheEngine:
        return self.runner.cache_engine

    def start(self, num_gpu_blocks: int, num_cpu_blocks: int, sampler: Sampler) -> None:
        """Allocate the draft cache with the target's block counts."""
        cache = CacheEngine(self.spec, num_gpu_blocks, num_cpu_blocks, self.device)
        self.runner = ModelRunner(self.model, cache, LoRAPool(self.model, self.device), self.device)
        self.sampler = sampler

    def release(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)

    def _forward(self, chunks: list[tuple[SeqInput, int, list[int]]]) -> torch.Tensor:
        """One packed draft forward: (sequence, start position, tokens) per sequence; returns
        the logits of each chunk's last token, [len(chunks), vocab]."""
        seqs = [SeqInput(s.seq_id, start, toks, s.block_table, True) for s, start, toks in chunks]
        return self.runner.run(StepInput(seqs)).logits

    def _draw(self, logits: torch.Tensor, seqs: list) -> tuple[list[int], torch.Tensor]:
        """Draft tokens from the draft's distribution (argmax for greedy requests)."""
        probs = self.sampler.probabilities(logits, seqs)  # [rows, vocab]
        noise = self.sampler.exponential_noise(probs, seqs)
        return (probs / noise).argmax(-1).tolist(), probs

    @torch.inference_mode()
    def propose(self, inputs: StepInput) -> Drafts:
        self.cache_engine.apply(inputs)
        seqs = inputs.seqs
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        if not seqs:
            return Drafts(tokens, [])
        # 1. catch up: every scheduled sequence runs what its draft KV lacks up to the end
        # of this step's chunk; drafting sequences sample their first draft from it
        chunks = []
        for s in seqs:
            end = s.start_pos + s.num_new_tokens
            start = min(self.computed.get(s.seq_id, s.start_pos), s.start_pos)
            chunks.append((s, start, s.token_ids[start:end]))
            self.computed[s.seq_id] = end
        logits = self._forward(chunks)
        drafting = [i for i, s in enumerate(seqs) if s.num_lookahead > 0]
        for step in range(max((seqs[i].num_lookahead for i in drafting), default=0)):
            if step > 0:  # 2. one more draft token per sequence that wants one
                drafting = [i for i in drafting if seqs[i].num_lookahead > step]
                chunks = []
                for i in drafting:
                    s = seqs[i]
                    pos = s.start_pos + s.num_new_tokens + step - 1
                    chunks.append((s, pos, [tokens[i][-1]]))
                    self.computed[s.seq_id] = pos + 1
                logits = self._forward(chunks)
            else:
                logits = logits[drafting]
            drawn, p = self._draw(logits, [seqs[i] for i in drafting])
            for row, i in enumerate(drafting):
                tokens[i].append(drawn[row])
                if seqs[i].gen_config.do_sample:
                    probs[i].append(p[row])
        return Drafts(tokens, [torch.stack(p) if p else None for p in probs])


Proposer = NgramProposer | DraftModelProposer


def build_proposer(cfg: EngineConfig, info: ModelInfo, device: torch.device) -> Proposer | None:
    """The proposer `cfg.speculative` asks for (loading the draft model), or None."""
    spec = cfg.speculative
    if spec is None:
        return None
    if spec.method != "draft_model":
        return NgramProposer(spec)
    model, draft_spec = load_draft_model(spec.draft_model, info, cfg, device)
    return DraftModelProposer(model, draft_spec, device)


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
    return model, CacheSpec.for_model(draft_info, engine_config, next(model.parameters()).dtype)


class _WithDrafts(TokenCounts):
    """A sequence as the sampler sees it after `extra` drafted tokens were accepted."""

    __slots__ = ("seq_id", "gen_config", "token_ids", "num_prompt_tokens")

    def __init__(self, seq, extra: list[int]) -> None:
        self.seq_id = seq.seq_id
        self.gen_config = seq.gen_config
        self.token_ids = seq.token_ids + extra
        self.num_prompt_tokens = seq.num_prompt_tokens


def _depends_on_history(seq) -> bool:
    """Whether the sampler's processing of this request's logits reads earlier tokens."""
    c = seq.gen_config
    return bool(
        c.repetition_penalty != 1.0
        or c.presence_penalty
        or c.frequency_penalty
        or c.no_repeat_ngram_size
        or c.min_new_tokens > seq.num_generated_tokens
    )


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for a batch, vectorised.

    p: [B, K + 1, V] target probabilities at each draft position and after the last one.
    q: [B, K, V] draft probabilities (zero rows past a sequence's drafts).
    drafts: [B, K] int64; num_drafts: [B]; uniform: [B, K] in [0, 1); noise: [B, V] Exp(1).
    Returns (num_accepted [B], next_token [B]): drafts[b, :num_accepted[b]] are kept and
    next_token[b] follows them.
    """
    batch, k = drafts.shape
    rows = torch.arange(batch)
    p_draft = p[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    q_draft = q.gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    # keep d with probability min(1, p(d) / q(d)), i.e. when u * q(d) < p(d)
    keep = (uniform * q_draft < p_draft) & (torch.arange(k)[None, :] < num_drafts[:, None])
    num_accepted = keep.long().cumprod(1).sum(1)  # [B]
    q_next = torch.cat([q, q.new_zeros(batch, 1, q.shape[2])], 1)[rows, num_accepted]  # [B, V]
    residual = (p[rows, num_accepted] - q_next).clamp_min(0)  # [B, V]
    # NOTE: a rejection implies p(d) < q(d), so the residual has mass; guard rounding anyway
    empty = residual.sum(1, keepdim=True) <= 0
    residual = torch.where(empty, p[rows, num_accepted], residual)
    return num_accepted, (residual / noise).argmax(-1)


class Verifier:
    """Turns the target's logits over drafted chunks into accepted tokens, and keeps the
    acceptance statistics in total (each step's per-sequence counts go out in its output)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verified_sequences = 0  # sequence-steps that had drafts

    def stats(self) -> dict:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
            "mean_accepted_per_step": self.num_accepted_tokens
            / max(1, self.num_verified_sequences),
        }

    def verify(
        self, logits: torch.Tensor, items: list[SeqInput], drafts: Drafts
    ) -> dict[int, SequenceOutput]:
        """logits: [rows, vocab], for each sampling item 1 + len(drafts) rows in order.
        Returns seq_id -> the accepted drafts and one token after them."""
        seqs, draft_lists, qs, views, first_row = [], [], [], [], []
        row = 0
        for seq, toks, q in zip(items, drafts.tokens, drafts.probs):
            if not seq.needs_sample:
                continue
            seqs.append(seq)
            draft_lists.append(toks)
            qs.append(q)
            first_row.append(row)
            history = _depends_on_history(seq)
            views.extend(
                _WithDrafts(seq, toks[:j]) if history else seq for j in range(len(toks) + 1)
            )
            row += len(toks) + 1
        if not seqs:
            return {}
        raw = logits  # logprobs are reported from the raw distribution
        if any(getattr(s, "grammar", None) is not None for s in seqs):  # structured outputs
            logits = logits.clone()
            self.sampler.grammars.apply_with_drafts(logits, seqs, first_row, draft_lists)
        batch, vocab = len(seqs), logits.shape[1]
        k = max(len(t) for t in draft_lists)
        num_drafts = torch.tensor([len(t) for t in draft_lists])
        drafts_t = torch.zeros(batch, max(k, 1), dtype=torch.long)
        for b, toks in enumerate(draft_lists):
            drafts_t[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        # padded row index of every logits row: (sequence, draft position)
        seq_of_row = torch.repeat_interleave(torch.arange(batch), num_drafts + 1)
        pos_of_row = torch.arange(row) - torch.tensor(first_row)[seq_of_row]
        num_accepted = torch.zeros(batch, dtype=torch.long)
        next_token = torch.zeros(batch, dtype=torch.long)
        sampled = [b for b, s in enumerate(seqs) if s.gen_config.do_sample]
        greedy_seqs = [b for b, s in enumerate(seqs) if not s.gen_config.do_sample]
        if greedy_seqs:  # keep drafts while they equal the argmax; then the argmax
            g_rows = torch.isin(seq_of_row, torch.tensor(greedy_seqs)).nonzero().squeeze(1)
            g_views = [views[r] for r in g_rows.tolist()]
            best = greedy(self.sampler._apply_penalties(logits[g_rows].clone(), g_views))
            targets = torch.zeros(batch, k + 1, dtype=torch.long)
            targets[seq_of_row[g_rows], pos_of_row[g_rows]] = best
            match = (targets[:, :k] == drafts_t[:, :k]) & (
                torch.arange(k)[None, :] < num_drafts[:, None]
            )
            acc = match.long().cumprod(1).sum(1)
            g = torch.tensor(greedy_seqs)
            num_accepted[g] = acc[g]
            next_token[g] = targets[g, acc[g]]
        if sampled:
            s_idx = torch.tensor(sampled)
            s_rows = torch.isin(seq_of_row, s_idx).nonzero().squeeze(1)
            probs = self.sampler.probabilities(logits[s_rows], [views[r] for r in s_rows.tolist()])
            local = torch.full((batch,), -1, dtype=torch.long)
            local[s_idx] = torch.arange(len(sampled))
            p = logits.new_zeros(len(sampled), k + 1, vocab)
            p[local[seq_of_row[s_rows]], pos_of_row[s_rows]] = probs
            q = logits.new_zeros(len(sampled), max(k, 1), vocab)
            for j, b in enumerate(sampled):
                n = len(draft_lists[b])
                if qs[b] is not None:
                    q[j, :n] = qs[b]
                elif n:  # a deterministic draft: a point mass on each draft token
                    q[j, torch.arange(n), drafts_t[b, :n]] = 1.0
            s_seqs = [seqs[b] for b in sampled]
            uniform = self.sampler.uniform(len(sampled), max(k, 1), s_seqs)
            noise = self.sampler.exponential_noise(p[:, 0], s_seqs)
            acc, tok = rejection_sample(p, q, drafts_t[s_idx], num_drafts[s_idx], uniform, noise)
            num_accepted[s_idx] = acc
            next_token[s_idx] = tok
        results: dict[int, SequenceOutput] = {}
        acc_list, next_list = num_accepted.tolist(), next_token.tolist()
        for b, seq in enumerate(seqs):
            m = acc_list[b]
            out_tokens = [*draft_lists[b][:m], next_list[b]]
            rows = raw[first_row[b] : first_row[b] + m + 1]
            sampled = self.sampler.results(rows, out_tokens, [seq.gen_config] * (m + 1))
            sampled[-1].error = self.sampler.grammars.accept_tokens(seq, out_tokens)
            results[seq.seq_id] = sequence_output(sampled, len(draft_lists[b]), m)
            if draft_lists[b]:
                self.num_draft_tokens += len(draft_lists[b])
                self.num_accepted_tokens += m
                self.num_verified_sequences += 1
        return results
