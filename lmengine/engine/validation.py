"""Request validation, in one place: what the engine refuses, and the message it gives.

`RequestValidator.validate` runs in the submitting thread (the RequestManager calls it before
a request enters the engine) and reads only what does not change while the engine runs, plus
the set of adapter names, which is swapped whole. `RequestValidator.admit` runs on the loop
thread when the request is taken in, for what only the loop knows: a session already busy, an
adapter removed since the request was validated. Both raise RequestError, whose message
becomes the request's `error`.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmengine.config import GenerationConfig
from lmengine.engine.request import AddRequest, RequestError
from lmengine.engine.research import ResearchSpec
from lmengine.scheduler.adapter_manager import AdapterManager
from lmengine.scheduler.qos import QoS, QoSError

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar
from lmengine.scheduler.sequence import token_limit


@dataclass
class RequestValidator:
    """The engine's limits, and the checks of a request against them."""

    vocab_size: int
    session_len: int  # tokens a sequence may hold at most
    max_batch_size: int
    num_blocks: int  # device KV blocks
    block_size: int
    is_speculative: bool
    adapter_names: Callable[[], frozenset[str]]  # the adapters loaded now
    qos: QoS | None = None
    num_layers: int = 0  # decoder layers (research hooks address them)
    hidden_size: int = 0
    # structured outputs: compiles a spec (engine/structured.py); None without a tokenizer
    compile_grammar: Callable[[dict], CompiledGrammar] | None = None

    def validate(self, req: AddRequest) -> None:
        """Any thread: refuse a malformed request."""
        cfg = req.gen_config
        if not isinstance(cfg, GenerationConfig):
            raise RequestError(f"gen_config must be a GenerationConfig, got {cfg!r}")
        try:
            cfg.__post_init__()  # NOTE: fields may have been changed since creation
        except ValueError as e:
            raise RequestError(f"invalid generation config: {e}") from None
        ids = req.input_ids
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise RequestError("input_ids must be a list of integer token ids")
        if not ids:
            raise RequestError("empty prompt: input_ids has no tokens")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) >= self.session_len:
            raise RequestError(
                f"prompt of {len(ids)} tokens leaves no room to generate within "
                f"session_len={self.session_len}"
            )
        outside = [t for t in cfg.stop_token_ids or [] if t >= self.vocab_size]
        if outside:
            raise RequestError(
                f"stop token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        names = self.adapter_names()
        if req.adapter_name is not None and req.adapter_name not in names:
            loaded = ", ".join(sorted(names)) or "none"
            raise RequestError(f"unknown adapter {req.adapter_name!r} (loaded: {loaded})")
        if req.priority is not None and (
            isinstance(req.priority, bool) or not isinstance(req.priority, int)
        ):
            raise RequestError(f"priority must be an integer or None, got {req.priority!r}")
        self._validate_beams(req)
        if cfg.logits_processors and self.is_speculative:
            raise RequestError(
                "logits_processors are not supported with speculative decoding (the drafts "
                "are verified against the unprocessed distribution)"
            )
        req.research = ResearchSpec.from_config(cfg, self.num_layers, self.hidden_size)
        if cfg.structured_outputs is not None:
            if self.compile_grammar is None:
                raise RequestError("structured_outputs need the model's tokenizer")
            req.grammar = self.compile_grammar(cfg.structured_outputs)
        if self.qos is not None:
            try:
                self.qos.tenant(req.user_id)
            except QoSError as e:
                raise RequestError(str(e)) from None

    def _validate_beams(self, req: AddRequest) -> None:
        """Refuse a beam request whose k beams could not run side by side, in the batch or in
        the KV pool (the group could then wait for itself forever)."""
        cfg = req.gen_config
        if cfg.num_beams == 1:
            return
        if self.is_speculative:
            raise RequestError(
                f"num_beams={cfg.num_beams}: beam search is not supported with speculative decoding"
            )
        if cfg.num_beams > self.max_batch_size:
            raise RequestError(
                f"num_beams={cfg.num_beams} is more than max_batch_size={self.max_batch_size}"
            )
        max_len = token_limit(len(req.input_ids), cfg.max_new_tokens, self.session_len)
        need = cfg.num_beams * -(-max_len // self.block_size)
        if need > self.num_blocks:
            raise RequestError(
                f"num_beams={cfg.num_beams} with up to {max_len} tokens per beam may need {need} "
                f"KV blocks, the pool has {self.num_blocks}: lower num_beams or max_new_tokens"
            )

    def admit(
        self, req: AddRequest, running: Container[int], adapters: AdapterManager | None
    ) -> int | None:
        """Loop thread: refuse a request the engine's current state cannot take. Returns the
        id of the request's adapter (None without one)."""
        if req.request_id in running:
            raise RequestError(f"session {req.request_id} already has a running request")
        if req.adapter_name is None:
            return None
        adapter_id = adapters.id_of(req.adapter_name) if adapters is not None else None
        if adapter_id is None:
            raise RequestError(f"unknown adapter {req.adapter_name!r}: it was removed")
        return adapter_id
