"""Structured outputs: generation constrained to a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar, with xgrammar.

`GrammarCompiler` turns a request's `structured_outputs` into an xgrammar CompiledGrammar for
the engine's tokenizer and vocabulary (JSON without free whitespace between its tokens), in
the submitting thread (xgrammar caches compiled grammars per schema, so equal schemas compile
once); a grammar that does not compile fails that request with xgrammar's message. On the
model side, `GrammarMasks` keeps one matcher per constrained sequence: before sampling it
fills the token bitmask of every constrained row and applies it to the batch's logits in one
operation; after sampling it advances the matchers by the chosen tokens. A finished
sequence's matcher goes with `finished_seq_ids`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmengine.engine.request import RequestError

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; the user needs the rest
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def library_message(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip()) or type(e).__name__


def without_raw_control_chars(schema: Any) -> Any:
    """The schema with a `pattern` on every length-bounded string that has none.

    NOTE: xgrammar 0.2.8 writes a string with minLength/maxLength as a repetition of
    `[^"\\\r\n]`, which lets raw control characters (U+0000-U+001F) in, and JSON forbids
    them: a weak model then writes invalid JSON. The same bounds as a pattern (instead of
    minLength/maxLength) compile to a regex that keeps them out (escapes stay out, as in
    xgrammar's own rule)."""
    if isinstance(schema, list):
        return [without_raw_control_chars(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: without_raw_control_chars(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    free = not any(k in out for k in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and bounded and free:
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        count = f"{{{low},{'' if high is None else int(high)}}}"
        out["pattern"] = "^" + '[^\\x00-\\x1f"\\\\]' + count + "$"
    return out


def tag_without_raw_control_chars(tag: Any) -> Any:
    """A structural tag with `without_raw_control_chars` applied to each JSON schema in it."""
    if isinstance(tag, list):
        return [tag_without_raw_control_chars(t) for t in tag]
    if not isinstance(tag, dict):
        return tag
    out = {k: tag_without_raw_control_chars(v) for k, v in tag.items() if k != "json_schema"}
    if "json_schema" in tag:
        out["json_schema"] = without_raw_control_chars(tag["json_schema"])
    return out


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON-escaped literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# xgrammar's cache of compiled grammars keeps one entry per distinct schema, regex or grammar,
# and its default has no limit: a client sending ever new schemas would grow it without end.
# Past this many bytes xgrammar drops the least recently used (a schema compiles again).
GRAMMAR_CACHE_BYTES = 64 << 20


class GrammarCompiler:
    """Compiles `structured_outputs` specs for one tokenizer and vocabulary (xgrammar's
    compiler and its cache, bounded at GRAMMAR_CACHE_BYTES). Any thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=2, cache_limit_bytes=GRAMMAR_CACHE_BYTES
        )

    def cache_bytes(self) -> int:
        """What the cache of compiled grammars holds now, in bytes."""
        return int(self._compiler.get_cache_size_bytes())

    def compile(self, spec: dict) -> CompiledGrammar:
        """The CompiledGrammar of a `structured_outputs` spec (its shape already checked by
        GenerationConfig); RequestError with xgrammar's message when it does not compile."""
        ((kind, value),) = spec.items()
        try:
            if kind in ("json", "json_object"):  # json_object: any JSON object (OpenAI's)
                schema = value if kind == "json" else {"type": "object"}
                schema = json.loads(schema) if isinstance(schema, str) else schema
                schema = json.dumps(without_raw_control_chars(schema))
                # NOTE: compact JSON (no free whitespace between tokens): a weak model given
                # the freedom fills its budget with spaces and newlines
                return self._compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(value))
            if kind == "structural_tag":
                tag = json.loads(value) if isinstance(value, str) else value
                return self._compiler.compile_structural_tag(tag_without_raw_control_chars(tag))
            return self._compiler.compile_grammar(value)
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError) on bad input
            raise RequestError(
                f"structured_outputs[{kind!r}] does not compile: {library_message(e)}"
            ) from None


DEAD_END = (
    "structured output: no token of the model's vocabulary can continue the constraint "
    "(it asks for text this tokenizer cannot write)"
)


class GrammarMasks:
    """One xgrammar matcher per constrained sequence (by seq_id), on the sampling side."""

    def __init__(self) -> None:
        self._matchers: dict[int, Any] = {}

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def _matcher(self, seq) -> Any:
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            import xgrammar as xgr

            matcher = self._matchers[seq.seq_id] = xgr.GrammarMatcher(seq.grammar)
        return matcher

    def apply(self, logits: torch.Tensor, seqs: Sequence) -> tuple[list[int], dict[int, str]]:
        """Mask, in place, the tokens each constrained row's grammar forbids next (logits
        [rows, vocab], row i for seqs[i]). Returns the rows whose matchers advance by the
        chosen token, and row -> error for rows where no token of the vocabulary can
        continue (a constraint this tokenizer cannot write, e.g. a regex with a character
        it has no bytes for)."""
        import xgrammar as xgr

        rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        if not rows:
            return rows, {}
        bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[1])  # [rows, words] int32
        for i in rows:
            self._matcher(seqs[i]).fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        dead = {i for i in rows if not bitmask[i].any()}
        errors = dict.fromkeys(dead, DEAD_END)
        return [i for i in rows if i not in dead], errors

    def apply_with_drafts(
        self,
        logits: torch.Tensor,
        seqs: Sequence,
        first_rows: Sequence[int],
        drafts: Sequence[list[int]],
    ) -> None:
        """Speculative decoding: mask, in place, the rows of every constrained sequence's
        chunk end and drafts (logits [rows, vocab]; sequence b's rows from first_rows[b]):
        row j with the grammar's state after drafts[b][:j]. Drafts the grammar refuses leave
        their row unmasked past the refusal (the verifier never reaches it: the refused
        draft has probability 0 in the row before). The matchers are rolled back after."""
        import xgrammar as xgr

        rows: list[int] = []
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        for seq, first, toks in zip(seqs, first_rows, drafts):
            if getattr(seq, "grammar", None) is None:
                continue
            matcher = self._matcher(seq)
            taken = 0
            for j in range(len(toks) + 1):
                matcher.fill_next_token_bitmask(bitmask, first + j)
                rows.append(first + j)
                if j == len(toks) or not matcher.accept_token(toks[j]):
                    break
                taken += 1
            if taken:
                matcher.rollback(taken)
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def accept_tokens(self, seq, tokens: list[int]) -> str | None:
        """Advance a constrained sequence's matcher by a step's tokens; an error message if
        the grammar refuses one (never after its mask, except for a row it masked entirely)."""
        if getattr(seq, "grammar", None) is None:
            return None
        matcher = self._matcher(seq)
        for token in tokens:
            if not matcher.accept_token(token):
                return f"structured output: the grammar refused token {token}"
        return None

    def accept(self, seqs: Sequence, rows: list[int], tokens: list[int]) -> dict[int, str]:
        """Advance the matchers of `rows` by their chosen tokens; row -> error message."""
        errors = {i: self.accept_tokens(seqs[i], [tokens[i]]) for i in rows}
        return {i: e for i, e in errors.items() if e is not None}
