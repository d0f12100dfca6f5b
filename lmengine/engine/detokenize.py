"""Incremental detokenization that never emits half a multi-byte character.

Each step decodes a short window of tokens twice, with and without the newest ones, and emits
the difference only once it no longer ends in U+FFFD (an incomplete UTF-8 sequence). The
window starts a few prompt tokens back so the first word keeps its leading space.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.ids = context  # context tokens, then generated ones
        self.prefix_offset = 0  # window start
        self.read_offset = len(context)  # tokens before this are already in `text`
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly readable text (may be empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
