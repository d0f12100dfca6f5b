"""Greedy reference outputs from plain transformers, one prompt at a time (no padding)."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def _load(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, ignore_eos=False):
    """Generated token ids per prompt (EOS included when it ends the generation)."""
    model = _load(path)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
            if ignore_eos:
                kwargs["eos_token_id"] = None
            out = model.generate(torch.tensor([ids]), attention_mask=None, **kwargs)
            outs.append(out[0, len(ids) :].tolist())
    return outs


def hf_beam(path: str, ids: list[int], cfg) -> tuple[list[list[int]], list]:
    """transformers' beam search: generated ids of the returned sequences (cut after their
    end token; transformers pads shorter ones) and their scores."""
    model = _load(path)
    eos = [] if cfg.ignore_eos else [model.generation_config.eos_token_id]
    eos += list(cfg.stop_token_ids or [])
    kwargs = dict(
        max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens or None,
        num_beams=cfg.num_beams,
        length_penalty=cfg.length_penalty,
        early_stopping=cfg.early_stopping,
        num_return_sequences=cfg.num_return_sequences,
        repetition_penalty=cfg.repetition_penalty,
        no_repeat_ngram_size=cfg.no_repeat_ngram_size,
        eos_token_id=eos or None,
        do_sample=False,
    )
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    seqs = []
    for row in out.sequences[:, len(ids) :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        seqs.append(row[:cut])
    return seqs, out.sequences_scores.tolist()


def hf_forward(path: str, ids: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One transformers forward over `ids`: log-softmax of the logits [len, vocab] and the
    hidden states (output_hidden_states: embeddings, then after each layer) [len, hidden]."""
    model = _load(path)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float().log_softmax(-1), tuple(h[0] for h in out.hidden_states)
