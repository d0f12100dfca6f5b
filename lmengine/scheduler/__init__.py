"""Scheduling: sequences, paged KV blocks, ordering policies. Pure Python: never imports torch."""

from __future__ import annotations

from lmengine.scheduler.adapter_manager import AdapterManager
from lmengine.scheduler.block_manager import BlockManager, BlockPool
from lmengine.scheduler.policies import Policy, get_policy, register_policy
from lmengine.scheduler.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from lmengine.scheduler.sequence import Sequence, SequenceStatus

__all__ = [
    "AdapterManager",
    "BlockManager",
    "BlockPool",
    "Policy",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "get_policy",
    "register_policy",
]
