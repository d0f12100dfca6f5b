"""What the benchmark measured: one row per (workload, system, metric), and the ratios of
lmengine's rows to transformers' rows."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

LM, HF_STATIC, HF_CB = "lmengine", "transformers static", "transformers CB"


class BenchError(RuntimeError):
    """A system produced something other than the requested work (errors, wrong lengths)."""


@dataclass
class Row:
    """One measured number of one system on one workload: every timed run's value, or the
    error that stopped the system. It only holds and compares values; it never measures."""

    workload: str
    system: str
    metric: str
    runs: list[float] = field(default_factory=list)
    higher_is_better: bool = True
    error: str | None = None
    note: str = ""

    @property
    def best(self) -> float | None:
        if not self.runs:
            return None
        return max(self.runs) if self.higher_is_better else min(self.runs)

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None

    def speedup_over(self, other: Row | None) -> float | None:
        """How much better this row is than `other` (>1: better), on the best runs."""
        if other is None or self.best is None or other.best is None:
            return None
        if not self.best or not other.best:
            return None
        return self.best / other.best if self.higher_is_better else other.best / self.best

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(best=self.best, median=self.median)
        return d


def find_row(rows: list[Row], workload: str, system: str, metric: str) -> Row | None:
    """The row of `system` on `workload` for `metric` that has no error, else None."""
    for row in rows:
        if row.workload == workload and row.system == system:
            if row.metric == metric and row.error is None:
                return row
    return None


# (workload, metric, the transformers system, key in the report and the JSON)
_RATIOS = [
    ("W1", "output tok/s", HF_STATIC, "w1 lmengine / transformers static"),
    ("W1", "output tok/s", HF_CB, "w1 lmengine / transformers generate_batch"),
    ("W2", "TTFT ms", HF_STATIC, "w2 TTFT: transformers / lmengine"),
    ("W2", "decode tok/s", HF_STATIC, "w2 decode lmengine / transformers"),
    ("W3", "prefill tok/s", HF_STATIC, "w3 prefill lmengine / transformers static"),
]


def ratios(rows: list[Row]) -> dict[str, float | None]:
    """lmengine over each transformers system, best runs (>1: lmengine better)."""
    out: dict[str, float | None] = {}
    for wl, metric, other, key in _RATIOS:
        lm = find_row(rows, wl, LM, metric)
        if not any(r.workload == wl and r.system == other for r in rows):
            continue  # not run (workload not selected, or --skip-hf-batch)
        out[key] = lm.speedup_over(find_row(rows, wl, other, metric)) if lm else None
    return out
