"""Batched sampling: one pass over the [num_samples, vocab] logits for the whole batch.

Order of operations (as transformers): repetition penalty, OpenAI presence and frequency
penalties (over the generated tokens only, as OpenAI and vLLM), no-repeat-ngram ban, min-new-tokens
ban of stop tokens, then greedy argmax, or temperature -> top-k -> top-p -> draw. Draws use the
exponential-race trick (argmax of p / Exp(1) noise); a request with `random_seed` draws its noise
from its own generator, so its tokens do not depend on the rest of the batch. Logprobs are those
of the model's raw distribution (before any processing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmengine.engine.step import SequenceOutput
from lmengine.engine.structured import GrammarMasks
from lmengine.kernels import cpu_ext


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # raw logprob of token_id, when asked
    top_logprobs: dict[int, float] | None = None  # top-N alternatives and the chosen token
    error: str | None = None  # the request's logits processor failed: the request ends


def sequence_output(
    results: list[SampleResult], num_draft_tokens: int = 0, num_accepted_tokens: int = 0
) -> SequenceOutput:
    """A sequence's step result from its sampled tokens, in order (logprobs when asked)."""
    asked = results[0].top_logprobs is not None
    return SequenceOutput(
        [r.token_id for r in results],
        [r.top_logprobs for r in results] if asked else None,
        num_draft_tokens,
        num_accepted_tokens,
        next((r.error for r in results if r.error is not None), None),
    )


def apply_logits_processors(logits: torch.Tensor, seqs: Sequence) -> dict[int, str]:
    """Run each request's logits processors on its row of `logits` [rows, vocab], in place,
    in order, each called as `processor(token_ids, row)` with a copy of the request's tokens
    so far (transformers' and vLLM's convention). A processor that raises or returns
    something else than a row of the same shape fails its own request only: returns
    row -> error message for those."""
    errors = {}
    vocab = logits.shape[1]
    for i, seq in enumerate(seqs):
        processors = seq.gen_config.logits_processors
        if not processors:
            continue
        row = logits[i]
        for processor in processors:
            name = getattr(processor, "__name__", type(processor).__name__)
            try:
                row = processor(list(seq.token_ids), row)
            except Exception as e:
                errors[i] = f"logits processor {name} raised {type(e).__name__}: {e}"
                break
            if not (isinstance(row, torch.Tensor) and tuple(row.shape) == (vocab,)):
                got = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
                errors[i] = (
                    f"logits processor {name} must return a tensor of shape ({vocab},), got {got}"
                )
                break
        else:
            if row.data_ptr() != logits[i].data_ptr():
                logits[i] = row
    return errors


def banned_ngram_tokens(token_ids: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already present in `token_ids`."""
    if n <= 0 or len(token_ids) < n:
        return []
    prefix = tuple(token_ids[len(token_ids) - n + 1 :])
    banned = []
    for i in range(len(token_ids) - n + 1):
        if tuple(token_ids[i : i + n - 1]) == prefix:
            banned.append(token_ids[i + n - 1])
    return banned


def openai_penalties(
    logits: torch.Tensor,
    generated: list[list[int]],
    presence: list[float],
    frequency: list[float],
) -> torch.Tensor:
    """OpenAI's presence and frequency penalties, one row per sequence, in one pass:
    `logit[j] -= presence * (count[j] > 0) + frequency * count[j]`, where `count[j]` is how
    often token j occurs among the row's generated tokens. logits: [num_rows, vocab]."""
    num_rows, vocab = logits.shape
    dev = logits.device
    width = max((len(g) for g in generated), default=0)
    counts = torch.zeros(num_rows, vocab + 1, device=dev)  # [num_rows, vocab + 1]
    if width:
        # NOTE: rows are padded with the extra column `vocab`, dropped below
        index = torch.tensor([g + [vocab] * (width - len(g)) for g in generated], device=dev)
        counts.scatter_add_(1, index, torch.ones(index.shape, device=dev))
    counts = counts[:, :vocab]  # [num_rows, vocab]
    presence_t = torch.tensor(presence, device=dev, dtype=logits.dtype)[:, None]
    frequency_t = torch.tensor(frequency, device=dev, dtype=logits.dtype)[:, None]
    return logits - presence_t * (counts > 0).to(logits.dtype) - frequency_t * counts


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax per row, [rows]; NaN entries (0/0 under an extreme penalty) never win."""
    tokens = argmax_rows(logits)  # a NaN counts as the maximum: only such rows need more
    nan_rows = logits.gather(1, tokens[:, None])[:, 0].isnan()
    if bool(nan_rows.any()):
        rows = logits[nan_rows]
        tokens[nan_rows] = rows.masked_fill(rows.isnan(), float("-inf")).argmax(-1)
    return tokens


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of a 2-D tensor (the first maximum; a row's first NaN if it has one),
    compiled on the CPU, where torch's argmax is ~10x slower than a vectorised max."""
    if x.dim() == 2 and x.dtype == torch.float32 and not x.is_cuda and x.is_contiguous():
        ext = cpu_ext.load()
        if ext is not None and x.shape[1] > 0:
            return ext.argmax_rows(x)
    return x.argmax(-1)


def greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """The distribution of greedy decoding: per row, 1 on its `greedy` token, [rows, vocab]."""
    return torch.zeros_like(logits).scatter_(1, greedy(logits)[:, None], 1.0)


def penalised(seqs: Sequence) -> bool:
    """Whether `Sampler._apply_penalties` changes any row of these sequences' logits."""
    for seq in seqs:
        c = seq.gen_config
        if c.repetition_penalty != 1.0 or c.presence_penalty or c.frequency_penalty:
            return True
        if c.no_repeat_ngram_size or seq.num_generated_tokens < c.min_new_tokens:
            return True
    return False


class Sampler:
    """Turns logits into tokens for a batch of sequences. Holds per-request generators."""

    def __init__(self, eos_token_ids: Sequence[int], device: torch.device) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self.grammars = GrammarMasks()  # structured outputs: one matcher per sequence

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self.grammars.release(seq_id)

    def _generator(self, seq) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.gen_config.random_seed)
            self._generators[seq.seq_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, seqs: Sequence) -> list[SampleResult]:
        """logits: [num_samples, vocab] float32, row i for seqs[i]."""
        cfgs = [s.gen_config for s in seqs]
        has_penalties = penalised(seqs)
        has_processors = any(c.logits_processors for c in cfgs)
        is_constrained = any(getattr(s, "grammar", None) is not None for s in seqs)
        # NOTE: raw `logits` stay untouched for the logprobs; the edits go to one copy
        edited = has_penalties or has_processors or is_constrained
        processed = logits.clone() if edited else logits
        if has_penalties:
            self._apply_penalties(processed, seqs)
        errors = {}
        if has_processors:  # after the penalties, as transformers
            errors = apply_logits_processors(processed, seqs)
        constrained, dead_ends = (
            self.grammars.apply(processed, seqs) if is_constrained else ([], {})
        )
        errors.update(dead_ends)
        tokens = greedy(processed)  # [num_samples]
        sample_rows = [i for i, c in enumerate(cfgs) if c.do_sample]
        if sample_rows:
            probs = self._sampling_probs(processed[sample_rows], [cfgs[i] for i in sample_rows])
            noise = self.exponential_noise(probs, [seqs[i] for i in sample_rows])
            tokens[sample_rows] = (probs / noise).argmax(-1)
        chosen = tokens.tolist()
        results = self.results(logits, chosen, cfgs)
        if constrained:
            errors.update(self.grammars.accept(seqs, constrained, chosen))
        for row, message in errors.items():
            results[row].error = message
        return results

    def split_beam_rows(
        self, logits: torch.Tensor, seqs: list
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor, list]:
        """Take the beam-search rows out of a step's logits ([num_samples, vocab], row i for
        seqs[i]). Returns (seq_id -> processed log-prob row [vocab], the other rows, their
        seqs).

        As transformers' beam search: log-softmax in float32, then the logits processors
        (repetition penalty, no-repeat-ngram, min-new-tokens: `_apply_penalties`, in the same
        order) on the log-probs."""
        rows = [i for i, s in enumerate(seqs) if getattr(s.gen_config, "num_beams", 1) > 1]
        if not rows:
            return {}, logits, seqs
        beam_seqs = [seqs[i] for i in rows]
        log_probs = logits[rows].float().log_softmax(-1)  # [num_beam_rows, vocab]
        log_probs = self._apply_penalties(log_probs, beam_seqs)
        log_probs.masked_fill_(log_probs.isnan(), float("-inf"))  # 0 * -inf, extreme penalties
        by_seq = {s.seq_id: log_probs[j] for j, s in enumerate(beam_seqs)}
        taken = set(rows)
        keep = [i for i in range(len(seqs)) if i not in taken]
        return by_seq, logits[keep], [seqs[i] for i in keep]

    def probabilities(self, logits: torch.Tensor, seqs: Sequence) -> torch.Tensor:
        """The distribution each row's token is drawn from, [num_rows, vocab]: after the
        penalties, a one-hot of the argmax for greedy rows, else the softmax after
        temperature, top-k and top-p. `seqs` may be any objects with a sequence's
        `gen_config`, `token_ids`, `generated_token_ids` and `num_generated_tokens`."""
        cfgs = [s.gen_config for s in seqs]
        logits = self._apply_penalties(logits.clone(), seqs)
        probs = greedy_one_hot(logits)
        sample_rows = [i for i, c in enumerate(cfgs) if c.do_sample]
        if sample_rows:
            probs[sample_rows] = self._sampling_probs(
                logits[sample_rows], [cfgs[i] for i in sample_rows]
            )
        return probs

    def _sampling_probs(self, logits: torch.Tensor, cfgs: Sequence) -> torch.Tensor:
        """softmax(_warp(logits)), [rows, vocab]. A row the warping turned into NaN (a
        temperature or penalty so extreme that its logits overflow to inf) becomes the one-hot
        of its greedy token: the limit that distribution tends to."""
        probs = self._warp(logits, cfgs).softmax(-1)
        bad = probs.isnan().any(-1)  # [rows]
        if bool(bad.any()):
            probs[bad] = greedy_one_hot(logits[bad])
        return probs

    def results(
        self, logits: torch.Tensor, tokens: list[int], cfgs: Sequence
    ) -> list[SampleResult]:
        """SampleResults for the chosen `tokens`, with logprobs of the raw `logits` rows
        where the request asked for them."""
        results = [SampleResult(t) for t in tokens]
        if all(c.logprobs is None for c in cfgs):
            return results
        raw_logprobs = logits.log_softmax(-1)  # [num_rows, vocab]
        for i, c in enumerate(cfgs):
            if c.logprobs is None:
                continue
            tok = tokens[i]
            top = {}
            if c.logprobs > 0:
                values, ids = raw_logprobs[i].topk(c.logprobs)
                top = dict(zip(ids.tolist(), values.tolist()))
            chosen = float(raw_logprobs[i, tok])
            top[tok] = chosen
            results[i].logprob = chosen
            results[i].top_logprobs = top
        return results

    def exponential_noise(self, like: torch.Tensor, seqs: Sequence) -> torch.Tensor:
        """Exp(1) noise shaped like `like` [rows, n]; a seeded request's row comes from its
        own generator. argmax(p / noise) draws from p (the exponential race)."""
        noise = torch.empty_like(like).exponential_()
        for row, seq in enumerate(seqs):
            if seq.gen_config.random_seed is not None:
                noise[row].exponential_(generator=self._generator(seq))
        return noise

    def uniform(self, rows: int, cols: int, seqs: Sequence) -> torch.Tensor:
        """U[0, 1) draws, [rows, cols]; a seeded request's row comes from its own generator."""
        out = torch.rand(rows, cols, device=self.device)
        for row, seq in enumerate(seqs):
            if seq.gen_config.random_seed is not None:
                out[row] = torch.rand(cols, generator=self._generator(seq), device=self.device)
        return out

    def _apply_penalties(self, logits: torch.Tensor, seqs: Sequence) -> torch.Tensor:
        """Repetition, presence and frequency penalties, banned n-grams and the stop tokens
        that min_new_tokens holds back, in place on `logits`; `penalised` says whether any
        of them applies."""
        cfgs = [s.gen_config for s in seqs]
        rows = [i for i, c in enumerate(cfgs) if c.repetition_penalty != 1.0]
        if rows:
            history = [seqs[i].token_ids for i in rows]
            width = max(len(h) for h in history)
            # pad with each row's own first token: a duplicate index rewrites the same value
            index = torch.tensor([h + [h[0]] * (width - len(h)) for h in history])
            index = index.to(logits.device)  # [num_rows, width]
            penalty = torch.tensor([cfgs[i].repetition_penalty for i in rows], device=logits.device)
            sub = logits[rows]
            picked = sub.gather(1, index)
            picked = torch.where(picked > 0, picked / penalty[:, None], picked * penalty[:, None])
            logits[rows] = sub.scatter(1, index, picked)
        rows = [i for i, c in enumerate(cfgs) if c.presence_penalty or c.frequency_penalty]
        if rows:
            logits[rows] = openai_penalties(
                logits[rows],
                [seqs[i].generated_token_ids for i in rows],
                [cfgs[i].presence_penalty for i in rows],
                [cfgs[i].frequency_penalty for i in rows],
            )
        for i, (seq, c) in enumerate(zip(seqs, cfgs)):
            if c.no_repeat_ngram_size:
                banned = banned_ngram_tokens(seq.token_ids, c.no_repeat_ngram_size)
                if banned:
                    logits[i, banned] = float("-inf")
            if seq.num_generated_tokens < c.min_new_tokens:
                stops = list(c.stop_token_ids or [])
                if not c.ignore_eos:
                    stops += self.eos_token_ids
                stops = [t for t in stops if t < logits.shape[1]]
                if stops:
                    logits[i, stops] = float("-inf")
        return logits

    def _warp(self, logits: torch.Tensor, cfgs: Sequence) -> torch.Tensor:
        """Temperature, then top-k and top-p (filtered entries -inf). logits: [rows, vocab]."""
        dev = logits.device
        temperature = torch.tensor([c.temperature for c in cfgs], device=dev)
        logits = logits / temperature[:, None]
        if any(c.top_k > 0 or c.top_p < 1.0 for c in cfgs):
            vocab = logits.shape[1]
            kept = [min(c.top_k, vocab) or vocab for c in cfgs]  # top_k 0: no cut
            widest = max(kept)
            if widest < vocab:  # every row has a top-k: only the top `widest` can survive
                sorted_logits, sorted_ids = logits.topk(widest, -1)  # [rows, widest]
            else:
                sorted_logits, sorted_ids = logits.sort(-1, descending=True)  # [rows, vocab]
            top_k = torch.tensor(kept, device=dev)
            beyond_k = torch.arange(sorted_logits.shape[1], device=dev)[None, :] >= top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(beyond_k, float("-inf"))
            # top-p over what top-k left (as transformers' warpers, in that order)
            probs = sorted_logits.softmax(-1)
            top_p = torch.tensor([c.top_p for c in cfgs], device=dev)
            beyond_p = (probs.cumsum(-1) - probs) > top_p[:, None]  # keeps at least the first
            sorted_logits = sorted_logits.masked_fill(beyond_p, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(1, sorted_ids, sorted_logits)
        return logits
