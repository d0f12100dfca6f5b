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
