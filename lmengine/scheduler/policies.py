"""Scheduling policies: the order in which sequences are served and which one is preempted.

A policy is a pure function of a sequence and the clock. `key(seq, now)` sorts ascending:
the smallest key is served first; the largest key among running sequences is the preemption
victim. Register a new one with `@register_policy("name")`; the Scheduler needs no change.
"""

from __future__ import annotations

from collections.abc import Callable

from lmengine.scheduler.sequence import Sequence

_POLICIES: dict[str, type[Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make a Policy subclass available as `EngineConfig.scheduling_policy`."""

    def wrap(cls: type[Policy]) -> type[Policy]:
        _POLICIES[name] = cls
        cls.name = name
        return cls

    return wrap


def get_policy(name: str, **kwargs) -> Policy:
    if name not in _POLICIES:
        raise ValueError(f"scheduling_policy must be one of {available_policies()}, got {name!r}")
    return _POLICIES[name](**kwargs)


def available_policies() -> list[str]:
    return sorted(_POLICIES)


class Policy:
    """Base class. Override `key`; `order` and `victim` follow from it."""

    name = "base"

    def key(self, seq: Sequence, now: float) -> tuple:
        raise NotImplementedError

    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        """Sequences in serving order, first to serve first."""
        return sorted(seqs, key=lambda s: self.key(s, now))

    def victim(self, seqs: list[Sequence], now: float) -> Sequence:
        """The sequence to preempt among `seqs`: the last in serving order."""
        return max(seqs, key=lambda s: self.key(s, now))


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
    """Larger `priority` first; None runs last; ties by arrival."""

    def key(self, seq: Sequence, now: float) -> tuple:
        missing = seq.priority is None
        return (missing, -(seq.priority or 0), seq.arrival_time, seq.seq_id)


@register_policy("sjf")
class SJFPolicy(Policy):
    """Shortest job first: smaller `max_new_tokens` first; ties by arrival."""

    def key(self, seq: Sequence, now: float) -> tuple:
        return (seq.max_new_tokens, seq.arrival_time, seq.seq_id)


@register_policy("ldf")
class LDFPolicy(Policy):
    """Longest (prompt + generated) first; ties by arrival."""

    def key(self, seq: Sequence, now: float) -> tuple:
        return (-seq.num_tokens, seq.arrival_time, seq.seq_id)
