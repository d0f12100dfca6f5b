"""Scheduling policies: the order in which sequences are served and which one is preempted.

A policy is a pure function of a sequence and the clock. `key(seq, now)` sorts ascending: the
smallest key is served first; the largest among running sequences is the preemption victim.
Register a new one with `@register_policy("name")`; the Scheduler needs no change:

    @register_policy("short_prompt_first")
    class ShortPromptFirst(Policy):
        def key(self, seq, now):
            return (seq.num_prompt_tokens, seq.arrival_time, seq.seq_id)

Aging (`priority_aging_s > 0`): every `priority_aging_s` seconds a sequence has waited since
its arrival count as one priority level. The `priority` policy adds the levels to the
request's priority; every other policy serves higher levels first and uses its own key within
a level. So under a constant stream of favoured work an old request eventually goes first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lmengine.scheduler.sequence import Sequence

_POLICIES: dict[str, type[Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make a Policy subclass available as `EngineConfig.scheduling_policy`."""

    def wrap(cls: type[Policy]) -> type[Policy]:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"register_policy({name!r}) needs a Policy subclass, got {cls!r}")
        _POLICIES[name] = cls
        cls.name = name
        return cls

    return wrap


def get_policy(name: str, **kwargs) -> Policy:
    """A new instance of the policy registered as `name` (kwargs: `priority_aging_s`)."""
    if name not in _POLICIES:
        raise ValueError(f"scheduling_policy must be one of {available_policies()}, got {name!r}")
    return _POLICIES[name](**kwargs)


def available_policies() -> list[str]:
    return sorted(_POLICIES)


class Policy:
    """Base class: override `key`. `rank` adds aging, `order` and `victim` follow from it.

    A policy only compares sequences; it never changes them nor the queues. Set
    `preempts_running = True` and override `outranks` to let a waiting sequence take the place
    of a running one when there is no room (the `priority` policy does).
    """

    name = "base"
    preempts_running = False

    def __init__(self, priority_aging_s: float = 0.0) -> None:
        if isinstance(priority_aging_s, bool) or not isinstance(priority_aging_s, (int, float)):
            raise ValueError(f"priority_aging_s must be a number, got {priority_aging_s!r}")
        if priority_aging_s < 0:
            raise ValueError(f"priority_aging_s must be >= 0, got {priority_aging_s!r}")
        self.priority_aging_s = float(priority_aging_s)

    def key(self, seq: Sequence, now: float) -> tuple:
        raise NotImplementedError

    def age_level(self, seq: Sequence, now: float) -> int:
        """Priority levels gained by waiting: 0 when aging is off."""
        if not self.priority_aging_s:
            return 0
        return max(0, math.floor((now - seq.arrival_time) / self.priority_aging_s))

    def rank(self, seq: Sequence, now: float) -> tuple:
        """Sort key including aging: smaller is served first."""
        return (-self.age_level(seq, now), *self.key(seq, now))

    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        """Sequences in serving order, first to serve first."""
        return sorted(seqs, key=lambda s: self.rank(s, now))

    def victim(self, seqs: list[Sequence], now: float) -> Sequence:
        """The sequence to preempt among `seqs`: the last in serving order."""
        return max(seqs, key=lambda s: self.rank(s, now))

    def outranks(self, seq: Sequence, running: Sequence, now: float) -> bool:
        """Whether waiting `seq` may preempt `running` when there is no room (never, here)."""
        return False


@register_policy("fcfs")
class FCFSPolicy(Policy):
    """First come, first served: earliest arrival first."""

    def key(self, seq: Sequence, now: float) -> tuple:
        return (seq.arrival_time, seq.seq_id)


@register_policy("lcfs")
class LCFSPolicy(Policy):
    """Last come, first served: latest arrival first."""

    def key(self, seq: Sequence, now: float) -> tuple:
        return (-seq.arrival_time, -seq.seq_id)


@register_policy("priority")
class PriorityPolicy(Policy):
    """Larger `priority` first; None runs last; ties by arrival.

    With aging on, a sequence's effective priority is its priority plus its age levels, and
    None counts as priority 0 (placed after an explicit 0 of the same effective priority), so
    that it can age too. A waiting sequence preempts a running one whose effective priority
    is strictly lower when there is no room for it.
    """

    preempts_running = True

    def effective_priority(self, seq: Sequence, now: float) -> int:
        return (seq.priority or 0) + self.age_level(seq, now)

    def rank(self, seq: Sequence, now: float) -> tuple:
        missing = seq.priority is None
        last = missing and not self.priority_aging_s  # NOTE: without aging None is always last
        return (last, -self.effective_priority(seq, now), missing, seq.arrival_time, seq.seq_id)

    def key(self, seq: Sequence, now: float) -> tuple:
        return self.rank(seq, now)

    def outranks(self, seq: Sequence, running: Sequence, now: float) -> bool:
        return self.rank(seq, now)[:2] < self.rank(running, now)[:2]


@register_policy("sjf")
class SJFPolicy(Policy):
    """Shortest job first: smaller `max_new_tokens` first; ties by arrival."""

    def key(self, seq: Sequence, now: float) -> tuple:
        return (seq.max_new_tokens, seq.arrival_time, seq.seq_id)


@register_policy("srpf")
class SRPFPolicy(Policy):
    """Shortest remaining prefill first: the sequences closest to their first token go
    first (decodes, whose remaining prefill is nothing, before every prompt), so that a burst
    of prompts gets its first tokens shortest first; ties by arrival. With
    `priority_aging_s`, a long prompt that keeps being overtaken gains a level per that many
    seconds and is not starved."""

    def key(self, seq: Sequence, now: float) -> tuple:
        remaining = seq.num_uncomputed if seq.num_uncomputed > 1 else 0
        return (remaining, seq.arrival_time, seq.seq_id)


@register_policy("ldf")
class LDFPolicy(Policy):
    """Longest (prompt + generated) first; ties by arrival."""

    def key(self, seq: Sequence, now: float) -> tuple:
        return (-seq.num_tokens, seq.arrival_time, seq.seq_id)
