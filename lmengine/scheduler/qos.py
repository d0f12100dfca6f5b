"""Multi-tenant QoS inside the scheduler, configured with LMDeploy-QoS's JSON format.

    {"enable_user_qos": true,
     "user_groups": ["Platinum", "Gold", "Silver", "Bronze"],          # highest first
     "user_group_map": {"Platinum": [{"id": "alice", "quota_pct": 100}],
                        "Gold": [{"id": "bob", "quota_pct": 75}, {"id": "carol", "quota_pct": 25}],
                        ...,
                        "Bronze": [{"id": "default", "quota_pct": 100}]},
     "window_s": 60}                                                     # optional (lmengine)

Rules:
- Between groups, strict priority: every request of a higher group is served (admitted, and
  swapped back in) before any of a lower group; with no room, a waiting request preempts a
  running one of a lower group. Aging never crosses groups.
- Within a group, a tenant is one `id` entry. Tenants are served by weighted fair queueing on
  the tokens served over the last `window_s` seconds (prompt tokens when first computed +
  generated tokens): the tenant with the least `served / quota` goes next. Tenants with
  nothing queued are simply not compared, so their quota goes to those present. Quotas are
  normalised within a group (they need not sum to 100); a quota of 0 is served only when no
  tenant with a quota is waiting. The scheduling policy orders requests of one tenant.
- A user in no group belongs to the `default` entry of the LAST group that has one (all such
  users share that entry's quota); with no `default` entry anywhere it is rejected. A
  request without `user_id` is treated as such a user.
- `enable_user_qos: false` turns QoS off: the plain policy, user ids are not checked.
- A malformed file raises ValueError at startup, naming the field.

Pure Python: never imports torch.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from dataclasses import dataclass, field

from lmengine.scheduler.sequence import Sequence

DEFAULT_ID = "default"


def tenant_of(seq: Sequence) -> Tenant:
    """The tenant of a sequence the QoS scheduler queued (`Scheduler.add_sequence` sets it)."""
    assert seq.tenant is not None, "a sequence queued without QoS"
    return seq.tenant


class QoSError(ValueError):
    """A request whose user the QoS configuration cannot place."""


@dataclass(frozen=True)
class Tenant:
    """One `{id, quota_pct}` entry: the unit that quotas and served tokens are counted for."""

    group: int  # index in user_groups: 0 is served first
    group_name: str
    user: str  # the entry id ("default" for every user that no entry names)
    quota: float  # normalised share of the group, in [0, 1]


@dataclass
class QoSConfig:
    """A validated LMDeploy-QoS configuration."""

    enable_user_qos: bool
    user_groups: list[str]
    tenants: dict[str, Tenant]  # user id -> tenant (ids named by an entry)
    default: Tenant | None  # the tenant of users that no entry names
    window_s: float = 60.0

    @classmethod
    def from_file(cls, path: str) -> QoSConfig:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"qos_config_path: cannot read {path!r}: {e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"qos_config_path: {path!r} is not valid JSON: {e}") from None
        return cls.from_dict(data, source=path)

    @classmethod
    def from_dict(cls, data: dict, source: str = "QoS config") -> QoSConfig:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"{source}: field {field_name!r} {why}")

        if not isinstance(data, dict):
            raise ValueError(f"{source}: must be a JSON object, got {type(data).__name__}")
        enable = data.get("enable_user_qos")
        if enable not in (True, False, 0, 1):
            raise bad("enable_user_qos", f"must be true or false, got {enable!r}")
        groups = data.get("user_groups")
        if not isinstance(groups, list) or not groups:
            raise bad("user_groups", f"must be a non-empty list of group names, got {groups!r}")
        for name in groups:
            if not isinstance(name, str) or not name:
                raise bad("user_groups", f"must hold non-empty strings, got {name!r}")
        if len(set(groups)) != len(groups):
            raise bad("user_groups", f"names a group twice: {groups!r}")
        group_map = data.get("user_group_map")
        if not isinstance(group_map, dict):
            raise bad("user_group_map", f"must be an object of group -> users, got {group_map!r}")
        extra = sorted(set(group_map) - set(groups))
        if extra:
            raise bad("user_group_map", f"has groups missing from user_groups: {extra}")
        window = data.get("window_s", 60.0)
        if isinstance(window, bool) or not isinstance(window, (int, float)) or window <= 0:
            raise bad("window_s", f"must be a number of seconds > 0, got {window!r}")

        tenants: dict[str, Tenant] = {}
        default: Tenant | None = None
        for g, name in enumerate(groups):
            entries = group_map.get(name)
            where = f"user_group_map.{name}"
            if not isinstance(entries, list) or not entries:
                raise bad(where, f"must be a non-empty list of {{id, quota_pct}}, got {entries!r}")
            quotas = []
            for i, entry in enumerate(entries):
                if not isinstance(entry, dict):
                    raise bad(f"{where}[{i}]", f"must be an object, got {entry!r}")
                uid, pct = entry.get("id"), entry.get("quota_pct")
                if not isinstance(uid, str) or not uid:
                    raise bad(f"{where}[{i}].id", f"must be a non-empty string, got {uid!r}")
                if isinstance(pct, bool) or not isinstance(pct, (int, float)):
                    raise bad(f"{where}[{i}].quota_pct", f"must be a number, got {pct!r}")
                if pct < 0 or not math.isfinite(pct):
                    raise bad(f"{where}[{i}].quota_pct", f"must be >= 0, got {pct!r}")
                quotas.append((uid, float(pct)))
            ids = [uid for uid, _ in quotas]
            if len(set(ids)) != len(ids):
                raise bad(where, f"names a user twice: {ids}")
            total = sum(p for _, p in quotas)
            for uid, pct in quotas:
                share = pct / total if total > 0 else 1.0 / len(quotas)
                tenant = Tenant(g, name, uid, share)
                if uid == DEFAULT_ID:
                    default = tenant  # NOTE: the last group with a default entry wins
                elif uid in tenants:
                    raise bad(where, f"user {uid!r} is already in group {tenants[uid].group_name}")
                else:
                    tenants[uid] = tenant
        return cls(bool(enable), list(groups), tenants, default, float(window))

    def resolve(self, user_id: str | None) -> Tenant:
        """The tenant a request of `user_id` belongs to; QoSError when there is none."""
        if user_id is not None and not isinstance(user_id, str):
            raise QoSError(f"user_id must be a string, got {user_id!r}")
        tenant = self.tenants.get(user_id) if user_id is not None else None
        if tenant is not None:
            return tenant
        if self.default is None:
            raise QoSError(
                f"user {user_id!r} is in no QoS user group and no group has a {DEFAULT_ID!r} entry"
            )
        return self.default


@dataclass
class _Usage:
    """Tokens served per tenant: a sliding window and a running total."""

    window_s: float
    events: deque = field(default_factory=deque)  # (time, tenant, tokens)
    in_window: dict[Tenant, int] = field(default_factory=dict)
    total: dict[Tenant, int] = field(default_factory=dict)

    def add(self, tenant: Tenant, tokens: int, now: float) -> None:
        self.events.append((now, tenant, tokens))
        self.in_window[tenant] = self.in_window.get(tenant, 0) + tokens
        self.total[tenant] = self.total.get(tenant, 0) + tokens

    def expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - self.window_s:
            _, tenant, tokens = self.events.popleft()
            self.in_window[tenant] -= tokens


class QoS:
    """Orders sequences by user group, then by tenant share, then by the policy; counts the
    tokens each tenant is served. Owned by the Scheduler; never touches queues or blocks."""

    def __init__(self, config: QoSConfig) -> None:
        self.config = config
        self.usage = _Usage(config.window_s)

    @classmethod
    def from_file(cls, path: str) -> QoS | None:
        """The QoS of a config file, or None when the file turns QoS off."""
        config = QoSConfig.from_file(path)
        return cls(config) if config.enable_user_qos else None

    def tenant(self, user_id: str | None) -> Tenant:
        return self.config.resolve(user_id)

    def charge(self, seq: Sequence, mark: int, now: float) -> None:
        """Count `seq`'s tokens up to `mark` (computed + sampled) as served, each token once:
        a recomputed prompt is not charged twice."""
        tokens = mark - seq.num_charged_tokens
        if tokens > 0 and seq.tenant is not None:
            seq.num_charged_tokens = mark
            self.usage.add(seq.tenant, tokens, now)

    def order(self, seqs: list[Sequence], policy, now: float) -> list[Sequence]:
        """Serving order: groups strictly; within a group, repeatedly the tenant with the least
        served / quota (counting what is already placed ahead); within a tenant, the policy."""
        self.usage.expire(now)
        by_tenant: dict[Tenant, list[Sequence]] = {}
        for seq in seqs:
            by_tenant.setdefault(tenant_of(seq), []).append(seq)
        result: list[Sequence] = []
        for group in sorted({t.group for t in by_tenant}):
            queues = {
                t: deque(policy.order(q, now)) for t, q in by_tenant.items() if t.group == group
            }
            served = {t: self.usage.in_window.get(t, 0) for t in queues}
            heap = [self._entry(t, served[t], queues[t][0], policy, now) for t in queues]
            heapq.heapify(heap)
            while heap:
                *_, tenant = heapq.heappop(heap)
                seq = queues[tenant].popleft()
                result.append(seq)
                # NOTE: charge what this one will be served now, so the next pick sees it
                served[tenant] += max(1, seq.num_tokens - seq.num_charged_tokens)
                if queues[tenant]:
                    entry = self._entry(tenant, served[tenant], queues[tenant][0], policy, now)
                    heapq.heappush(heap, entry)
        return result

    @staticmethod
    def _entry(tenant: Tenant, served: int, head: Sequence, policy, now: float) -> tuple:
        weight = (0, served / tenant.quota) if tenant.quota > 0 else (1, served)
        return (*weight, policy.rank(head, now), id(tenant), tenant)

    def outranks(self, seq: Sequence, running: Sequence) -> bool | None:
        """True/False when groups decide whether waiting `seq` may preempt `running`; None
        when both belong to the same tenant and the policy decides."""
        mine, theirs = tenant_of(seq), tenant_of(running)
        if mine.group != theirs.group:
            return mine.group < theirs.group
        return None if mine == theirs else False

    def stats(self, seqs_by_state: dict[str, list[Sequence]], now: float) -> dict:
        """Per group: queue lengths and served tokens (total and in the window); per user id:
        served tokens and the share of its group over the window."""
        self.usage.expire(now)
        groups = {
            name: {
                "num_waiting": 0,
                "num_running": 0,
                "num_swapped": 0,
                "num_served_tokens": 0,
                "num_window_tokens": 0,
            }
            for name in self.config.user_groups
        }
        for state, seqs in seqs_by_state.items():
            for seq in seqs:
                groups[tenant_of(seq).group_name][f"num_{state}"] += 1
        users: dict[str, dict] = {}
        tenants = [*self.config.tenants.values()]
        if self.config.default is not None:
            tenants.append(self.config.default)
        for t in tenants:
            total, window = self.usage.total.get(t, 0), self.usage.in_window.get(t, 0)
            groups[t.group_name]["num_served_tokens"] += total
            groups[t.group_name]["num_window_tokens"] += window
            users[t.user] = {
                "group": t.group_name,
                "quota": t.quota,
                "num_served_tokens": total,
                "num_window_tokens": window,
            }
        for u in users.values():
            group_window = groups[u["group"]]["num_window_tokens"]
            u["window_share"] = u["num_window_tokens"] / group_window if group_window else 0.0
        return {"groups": groups, "users": users}
