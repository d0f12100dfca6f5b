"""Timed runs: one untimed warm-up per system, then `repeat` timed runs of every system on one
workload, alternating (run 1 of each, then run 2 of each, ...)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

from lmengine.bench.results import Row

# (the rows a system fills, its untimed warm-up, one timed run returning a value per row)
System = tuple[list[Row], Callable[[], Any], Callable[[], list[float]]]


def log(msg: str) -> None:
    """Progress goes to stderr; stdout holds only the report."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def measure_interleaved(systems: list[System], repeat: int) -> list[Row]:
    """Warm up each system once, then run them in turn `repeat` times; returns their rows.

    NOTE: the timed runs alternate so that load which drifts during the benchmark (a shared
    machine) reaches every system alike instead of whichever ran last. A system that raises
    gets the error in its rows and runs no more; the others go on."""
    failed: set[int] = set()

    def attempt(i: int, step: str, fn: Callable[[], Any]) -> Any:
        rows = systems[i][0]
        label = f"{rows[0].workload} {rows[0].system}"
        try:
            result = fn()
        except Exception as e:
            msg = f"{type(e).__name__}: {e}".strip()
            log(f"{label}: FAILED: {msg}\n{traceback.format_exc()}")
            for row in rows:
                row.error = msg
            failed.add(i)
            return None
        if step != "warm-up":
            shown = ", ".join(f"{row.metric} {v:.2f}" for row, v in zip(rows, result, strict=True))
            log(f"{label}: {step}: {shown}")
        return result

    for i, (rows, warmup, _) in enumerate(systems):
        log(f"{rows[0].workload} {rows[0].system}: warm-up")
        attempt(i, "warm-up", warmup)
    for r in range(repeat):
        for i, (rows, _, run) in enumerate(systems):
            if i in failed:
                continue
            values = attempt(i, f"run {r + 1}/{repeat}", run)
            if values is not None:
                for row, v in zip(rows, values, strict=True):
                    row.runs.append(v)
    return [row for rows, _, _ in systems for row in rows]
