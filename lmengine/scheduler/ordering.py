"""Serving order: QoS groups and tenant shares first (when QoS is on), then the policy's rank.

The Scheduler asks it who goes first, who is preempted, and whether a waiting sequence may
push a running one out. Pure functions of the sequences and the clock.
"""

from __future__ import annotations

from lmengine.scheduler.policies import Policy
from lmengine.scheduler.qos import QoS
from lmengine.scheduler.sequence import Sequence


class ServingOrder:
    """The policy, with QoS on top when configured. Holds no queue."""

    def __init__(self, policy: Policy, qos: QoS | None = None) -> None:
        self.policy = policy
        self.qos = qos

    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        """`seqs` best first."""
        if self.qos is not None:
            return self.qos.order(seqs, self.policy, now)
        return self.policy.order(seqs, now)

    def victim(self, seqs: list[Sequence], now: float) -> Sequence:
        """The sequence to preempt among `seqs`: the last in serving order."""
        if self.qos is not None:
            return self.order(seqs, now)[-1]
        return self.policy.victim(seqs, now)

    def outranks(self, seq: Sequence, running: Sequence, now: float) -> bool:
        """Whether waiting `seq` may preempt `running` when there is no room for it: a higher
        QoS group always may; within one tenant (or without QoS) only if the policy says so."""
        if self.qos is not None:
            decided = self.qos.outranks(seq, running)
            if decided is not None:
                return decided
        return self.policy.preempts_running and self.policy.outranks(seq, running, now)
