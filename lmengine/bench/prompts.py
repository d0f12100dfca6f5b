"""The token ids the workloads run: chat prompts built from the lines of a prompt file, the
long ones grown line by line to a size in tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmengine.bench.flags import Sizes


def read_lines(path: str) -> list[str]:
    """The non-empty lines of `path`, stripped; ValueError if there are none."""
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        raise ValueError(f"no prompts in {path}")
    return lines


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as one user message through the chat template (a base model: the raw text)."""
    from lmengine.api import chat_token_ids

    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer(text)["input_ids"])
    return chat_token_ids(tokenizer, [{"role": "user", "content": text}])


def long_prompt(tokenizer: Any, lines: list[str], start: int, min_tokens: int) -> list[int]:
    """Chat ids of one user message made of prompt lines from `start` on, >= min_tokens."""
    parts: list[str] = []
    i = start
    while True:
        # grow by whole lines; re-tokenize only every few lines to stay cheap
        for _ in range(8):
            parts.append(lines[i % len(lines)])
            i += 1
        ids = chat_ids(tokenizer, " ".join(parts))
        if len(ids) >= min_tokens:
            while len(parts) > 1:  # trim back to the shortest that still reaches the size
                shorter = chat_ids(tokenizer, " ".join(parts[:-1]))
                if len(shorter) < min_tokens:
                    break
                parts.pop()
                ids = shorter
            return ids


@dataclass
class Prompts:
    """The token ids of every workload, built once before any system runs. Holds ids only;
    it never tokenizes again nor runs a model."""

    w1: list[list[int]]  # one chat prompt per line, cycling through the file
    w2: list[int]  # one long prompt
    w3: list[list[int]]  # long prompts starting at lines spread over the file

    @classmethod
    def build(cls, tokenizer: Any, lines: list[str], sizes: Sizes) -> Prompts:
        s, n = sizes, len(lines)
        w1 = [chat_ids(tokenizer, lines[i % n]) for i in range(s.num_prompts)]
        w2 = long_prompt(tokenizer, lines, 0, s.w2_prompt_tokens)
        step = max(1, n // max(1, s.w3_num_prompts))
        w3 = [
            long_prompt(tokenizer, lines, i * step, s.w3_prompt_tokens)
            for i in range(s.w3_num_prompts)
        ]
        return cls(w1, w2, w3)

    def needed_blocks(self, sizes: Sizes, workloads: list[str], block_size: int) -> int:
        """KV blocks for the largest selected workload (they run one after the other)."""

        def need(ids: list[list[int]], new: int) -> int:
            return sum(math.ceil((len(x) + new) / block_size) + 1 for x in ids)

        needs = [16]
        if "w1" in workloads:
            needs.append(need(self.w1, sizes.max_new_tokens))
        if "w2" in workloads:
            needs.append(need([self.w2], sizes.w2_new_tokens))
        if "w3" in workloads:
            needs.append(need(self.w3, sizes.w3_new_tokens))
        return max(needs) + 8
