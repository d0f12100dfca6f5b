"""A sequence: one request's tokens, how many of them are in the KV cache, and its blocks."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: types only: the scheduler reads none of these objects' insides
    from xgrammar import CompiledGrammar

    from lmengine.config import GenerationConfig
    from lmengine.engine.research import ResearchSpec
    from lmengine.scheduler.qos import Tenant


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted by nobody yet, or preempted by recompute
    RUNNING = "running"  # holds device blocks
    SWAPPED = "swapped"  # preempted by swap: its KV blocks are on the host pool
    FINISHED = "finished"


def token_limit(num_prompt_tokens: int, max_new_tokens: int, max_seq_len: int | None) -> int:
    """The length limit, in one place: a sequence ends ("length") when it holds this many
    tokens: its prompt plus `max_new_tokens`, and never more than `max_seq_len`."""
    limit = num_prompt_tokens + max_new_tokens
    return limit if max_seq_len is None else min(limit, max_seq_len)


class TokenCounts:
    """Counts over `token_ids` (prompt, then generated) and `num_prompt_tokens`; shared by
    Sequence and the views the speculative verifier builds of it."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(eq=False)
class Sequence(TokenCounts):
    """Token state of one sequence of a request (beam search runs several). The scheduler
    owns it; the engine appends sampled tokens through `Scheduler.update`. `gen_config` is
    opaque here except `max_new_tokens`."""

    seq_id: int
    request_id: int  # the engine's record of the request: Engine.requests[request_id]
    token_ids: list[int]  # prompt followed by generated tokens
    gen_config: GenerationConfig
    priority: int | None = None
    user_id: str | None = None
    adapter_name: str | None = None
    adapter_id: int | None = None  # the AdapterManager's id of adapter_name, fixed at arrival
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)  # device block ids, in order
    host_block_table: list[int] = field(default_factory=list)  # host block ids while SWAPPED
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of full blocks
    cache_salt: bytes | None = None  # prefix-cache root: the adapter's name and registration id
    num_preemptions: int = 0
    num_prompt_tokens: int = -1
    num_charged_tokens: int = 0  # tokens already counted as served to its QoS tenant
    tenant: Tenant | None = None  # the QoS tenant when QoS is on (set by the Scheduler)
    # nothing to compute until something outside the scheduler moves it on (a beam whose row
    # of this round is in, waiting for its group's other beams): never admitted while parked,
    # and the first to give its blocks back when nothing else can run
    parked: bool = False
    max_seq_len: int | None = None  # the engine's session_len (set by the Scheduler)
    # prefix caching (set by the engine from the request): how many leading tokens may come
    # from cached blocks (None: any; fewer when positions must be computed for prompt
    # logprobs or hidden states, or run steered) and whether its blocks may serve others (not
    # when steering changed them)
    max_cached_tokens: int | None = None
    shares_cache: bool = True
    research: ResearchSpec | None = None  # what the request asks of the forward, opaque here
    grammar: CompiledGrammar | None = None  # structured outputs (engine/structured.py)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens not in the cache yet: 1 for a decode, a prompt's rest for a prefill."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_new_tokens(self) -> int:
        return self.gen_config.max_new_tokens

    @property
    def max_num_tokens(self) -> int:
        """Tokens the sequence may hold at most (`token_limit`)."""
        return token_limit(self.num_prompt_tokens, self.gen_config.max_new_tokens, self.max_seq_len)

    def fork(self, seq_id: int, token_id: int) -> Sequence:
        """A new waiting sequence of the same request: these tokens and then `token_id`, no
        blocks, nothing computed (the Scheduler's `fork` gives it its parent's KV)."""
        return dataclasses.replace(
            self,
            seq_id=seq_id,
            token_ids=[*self.token_ids, token_id],
            status=SequenceStatus.WAITING,
            num_computed_tokens=0,
            block_table=[],
            host_block_table=[],
            block_keys=[],
            num_preemptions=0,
            parked=False,
        )

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
