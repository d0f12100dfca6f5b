"""Research hooks of a request: prompt scoring, reading hidden states, steering.

`ResearchSpec.from_config` checks a request's research fields against the model (layer range,
vector size and dtype) in the submitting thread and fixes them in the form the step carries:
resolved layer indices, steering vectors scaled and detached from the caller's tensor. The
step then asks the forward for the prompt rows' logits and the layers' rows
(`StepInput.from_output`), `prompt_logprobs` turns those logits into per-token logprobs on
rank 0, and `HiddenStates` gathers a request's rows step after step in position order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmengine.config import GenerationConfig
from lmengine.engine.request import RequestError
from lmengine.kernels.logprobs import logsumexp_max_rows

# NOTE: rows of prompt logits searched for their top N at once (N > 1): bounds the copies
_SCORE_BLOCK_ROWS = 512


@dataclass(frozen=True)
class ResearchSpec:
    """What one request asks of the forward, in the form each step carries."""

    prompt_logprobs: int | None = None  # top-N alternatives per prompt token
    prompt_logprobs_start: int = 0  # first prompt token scored
    hidden_layers: tuple[int, ...] = ()  # indices as transformers' output_hidden_states
    steering: tuple[tuple[int, torch.Tensor, int], ...] = ()  # (layer, scaled [hidden], start)
    pooling: str | None = None  # GenerationConfig.pooling
    pool_layer: int = 0  # the final norm's index (num_layers): the rows pooled

    def step_layers(self, start: int, end: int, num_prompt_tokens: int) -> tuple[int, ...]:
        """The layers whose rows a step running positions [start, end) records: the asked
        ones, and for pooling the final norm's (every chunk for "mean", the chunk holding the
        last prompt token for "last")."""
        if self.pooling is None or self.pool_layer in self.hidden_layers:
            return self.hidden_layers
        if self.pooling == "mean" or start < num_prompt_tokens <= end:
            return (*self.hidden_layers, self.pool_layer)
        return self.hidden_layers

    @property
    def max_cached_tokens(self) -> int | None:
        """Leading tokens the request may take from the prefix cache (None: any): none when
        it reads hidden states or pools over every position (every position must run; the last
        token, which "last" pooling reads, always runs), fewer than the first scored token
        (the position before it gives its logprob), and those before its first steered
        position (a cached block was computed without the vector)."""
        if self.hidden_layers or self.pooling == "mean":
            return 0
        limits = [start for _, _, start in self.steering]
        if self.prompt_logprobs is not None:
            limits.append(max(0, self.prompt_logprobs_start - 1))
        return min(limits, default=None)

    @classmethod
    def from_config(
        cls, cfg: GenerationConfig, num_layers: int, hidden_size: int
    ) -> ResearchSpec | None:
        """The spec of a request, None when it asks for nothing; RequestError when an ask
        does not fit the model."""
        asks = (cfg.prompt_logprobs, cfg.output_hidden_states, cfg.steering, cfg.pooling)
        if all(a is None for a in asks) and not cfg.steering:
            return None
        layers: tuple[int, ...] = ()
        if cfg.output_hidden_states == "all":
            layers = tuple(range(num_layers + 1))
        elif cfg.output_hidden_states is not None:
            layers = tuple(cfg.output_hidden_states)
            bad = [i for i in layers if i > num_layers]
            if bad:
                raise RequestError(
                    f"output_hidden_states: layer {bad[0]} is out of range; this model has "
                    f"indices 0..{num_layers} (0 = embeddings, i = after decoder layer i)"
                )
        steering = []
        for layer, sv in sorted((cfg.steering or {}).items()):
            if layer > num_layers:
                raise RequestError(
                    f"steering: layer {layer} is out of range; this model's decoder layers are "
                    f"1..{num_layers}"
                )
            steering.append((layer, _steering_vector(layer, sv, hidden_size), sv.start))
        start = cfg.prompt_logprobs_start
        return cls(cfg.prompt_logprobs, start, layers, tuple(steering), cfg.pooling, num_layers)


def _steering_vector(layer: int, sv, hidden_size: int) -> torch.Tensor:
    """`sv.scale * sv.vector` as a float32 CPU tensor of its own, after checking it."""
    v = sv.vector
    if not isinstance(v, torch.Tensor):
        raise RequestError(f"steering[{layer}]: the vector must be a torch.Tensor")
    if not (v.dtype.is_floating_point and v.dtype.itemsize >= 2):
        raise RequestError(
            f"steering[{layer}]: the vector must be float32, float16 or bfloat16, got {v.dtype}"
        )
    if tuple(v.shape) != (hidden_size,):
        raise RequestError(
            f"steering[{layer}]: the vector must have shape ({hidden_size},) (the model's "
            f"hidden size), got {tuple(v.shape)}"
        )
    out = v.detach().to("cpu", torch.float32) * float(sv.scale)  # [hidden]
    if not bool(torch.isfinite(out).all()) or not math.isfinite(sv.scale):
        raise RequestError(f"steering[{layer}]: the scaled vector has NaN or infinite values")
    return out


def prompt_logprobs(
    logits: torch.Tensor, seqs: list
) -> tuple[torch.Tensor, dict[int, tuple[int, list[dict[int, float]]]]]:
    """Split a step's logits [num_logits, vocab] into the prompt-scoring rows (per sequence
    `num_prompt_logits` rows, before its sampling rows) and the rest (returned, for sampling).
    The scoring row of position p gives the logprob of prompt token p + 1 and the top N.

    logprob = logit - logsumexp(row): the log-softmax is never written out, and a prompt token
    that is the row's top token gets the very same float as the top entry (lm-eval compares
    them for `is_greedy`). Returns (rest of the logits, seq_id -> (index of its first scored
    prompt token, one {token_id: logprob} per scored token))."""
    score_rows, rest_rows, targets = [], [], []
    row = 0
    for s in seqs:
        n = s.num_prompt_logits
        first = s.start_pos + s.prompt_logits_offset + 1  # first prompt token scored
        score_rows.extend(range(row, row + n))
        targets.extend(s.token_ids[first : first + n])
        rest_rows.extend(range(row + n, row + n + s.num_logits))
        row += n + s.num_logits
    device = logits.device
    rows = torch.tensor(score_rows, device=device)  # [num_scored]
    lse, best, best_ids = logsumexp_max_rows(logits, rows)  # [num_scored] each
    chosen = logits[rows, torch.tensor(targets, device=device)] - lse  # [num_scored]
    num_top = max(s.gen_config.prompt_logprobs or 0 for s in seqs if s.num_prompt_logits)
    top_values, top_ids = [], []
    if num_top == 1:
        top_values, top_ids = [(best - lse)[:, None]], [best_ids[:, None]]
    elif num_top:
        for at in range(0, len(score_rows), _SCORE_BLOCK_ROWS):
            part = rows[at : at + _SCORE_BLOCK_ROWS]
            values, ids = logits.index_select(0, part).topk(num_top, -1)  # [rows, num_top]
            top_values.append(values - lse[at : at + _SCORE_BLOCK_ROWS, None])
            top_ids.append(ids)
    chosen_l = chosen.tolist()
    values_l = torch.cat(top_values).tolist() if num_top else None
    ids_l = torch.cat(top_ids).tolist() if num_top else None
    out: dict[int, tuple[int, list[dict[int, float]]]] = {}
    i = 0
    for s in seqs:
        n = s.num_prompt_logits
        if not n:
            continue
        k = s.gen_config.prompt_logprobs
        entries = []
        for j in range(i, i + n):
            entry = dict(zip(ids_l[j][:k], values_l[j][:k])) if k else {}
            entry[targets[j]] = chosen_l[j]
            entries.append(entry)
        out[s.seq_id] = (s.start_pos + s.prompt_logits_offset + 1, entries)
        i += n
    if not rest_rows:  # no sequence samples this step (prefill chunks only)
        return logits[:0], out
    return logits[torch.tensor(rest_rows, device=device)], out


class HiddenStates:
    """A request's hidden states, per layer a growing [positions, hidden] CPU buffer written
    at the positions each step ran. Recomputed positions (after a preemption) are written
    again with the same values; rows of drafts the model rejected are overwritten by the
    tokens that replace them, and never read before."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.layers = layers
        self.num_valid = 0  # positions whose rows are final

    def write(self, start_pos: int, rows: dict[int, torch.Tensor]) -> None:
        for layer, part in rows.items():  # part: [n, hidden]
            if layer not in self.layers:  # recorded for another ask (pooling)
                continue
            end = start_pos + part.shape[0]
            buf = self.buffers.get(layer)
            if buf is None or buf.shape[0] < end:
                size = max(end, 2 * buf.shape[0] if buf is not None else 0)
                grown = part.new_empty((size, part.shape[1]), device="cpu")
                if buf is not None:
                    grown[: buf.shape[0]] = buf
                buf = self.buffers[layer] = grown
            buf[start_pos:end] = part

    def pool(self, pooling: str, num_positions: int) -> torch.Tensor:
        """The only layer's rows of positions 0..num_positions-1 pooled ("last": the last
        row; "mean": their mean), [hidden] float32."""
        (layer,) = self.layers
        rows = self.buffers[layer][:num_positions]
        return (rows[-1] if pooling == "last" else rows.float().mean(0)).float().clone()

    def view(self, num_positions: int) -> dict[int, torch.Tensor]:
        """Per layer the rows of positions 0..num_positions-1 (views of the buffers)."""
        return {layer: self.buffers[layer][:num_positions] for layer in self.layers}
