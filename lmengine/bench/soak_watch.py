"""Watching a soaked server (benchmarks/soak.py, tests/test_soak.py): its process's RSS, open
file descriptors and threads (from /proc/<pid>), KV blocks in use and the sizes of its bounded
tables (from /metrics), /health latency and the load's answers, sampled every few seconds; the
drift of each series (first window against the last); and the check once it is idle again
(every KV block free, RSS and descriptors back near their values after the warm-up)."""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from typing import Any

from lmengine.bench.soak import Tally, httpx
from lmengine.engine.malloc import IDLE_RELEASE_S

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")
IDLE_GAUGES = (
    "lmengine_num_requests_running",
    "lmengine_num_requests_waiting",
    "lmengine_kv_blocks_used",
    "lmengine_server_requests_in_flight",
)
# NOTE: one client for every sample: `httpx.get` builds a client (and an SSL context) per call,
# ~25 ms of the watcher's own time that a /health latency must not include
_CLIENT = httpx.Client(timeout=30)
SERIES = ("rss_mb", "num_fds", "num_threads", "kv_blocks_used", "health_ms", "answers_per_s")


def proc_stats(pid: int) -> dict[str, float]:
    """RSS (MB), open file descriptors and threads of process `pid`, from /proc."""
    status = dict(
        line.split(":", 1)
        for line in open(f"/proc/{pid}/status").read().splitlines()
        if ":" in line
    )
    return {
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
        "num_fds": len(os.listdir(f"/proc/{pid}/fd")),
        "num_threads": int(status["Threads"]),
    }


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = _CLIENT.get(url + "/metrics", headers=headers or {}).text
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def tables(metrics: dict[str, float]) -> dict[str, float]:
    """The server's bounded tables: state -> entries (lmengine_server_state_entries)."""
    prefix = 'lmengine_server_state_entries{state="'
    return {k[len(prefix) : -2]: v for k, v in metrics.items() if k.startswith(prefix)}


def wait_idle(url: str, headers: dict | None = None, timeout: float = 60.0) -> dict[str, float]:
    """Metrics once nothing runs, waits, holds a KV block or is in flight (or at `timeout`),
    and then long enough for the engine loop to hand its freed memory back to the OS
    (`IDLE_RELEASE_S`) and for the event loop to reap the connections the load closed."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url, headers)
        if sum(m.get(k, 0) for k in IDLE_GAUGES) == 0 or time.monotonic() > deadline:
            time.sleep(IDLE_RELEASE_S + 1.0)
            return m
        time.sleep(0.2)


def snapshot(pid: int, url: str, headers: dict | None = None) -> dict[str, Any]:
    """One sample: the process's resources, KV blocks in use, tables, /health latency."""
    start = time.monotonic()
    health = _CLIENT.get(url + "/health")
    health_ms = (time.monotonic() - start) * 1e3
    m = scrape(url, headers)
    return {
        **proc_stats(pid),
        "kv_blocks_used": m.get("lmengine_kv_blocks_used", 0.0),
        "health_ms": round(health_ms, 2) if health.status_code == 200 else -1.0,
        "tables": tables(m),
    }


class Watcher(threading.Thread):
    """Samples the server every `every_s` seconds while the load runs (`series`)."""

    def __init__(self, pid: int, url: str, tally: Tally, headers=None, every_s=5.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.url, self.tally = pid, url, tally
        self.headers, self.every_s = headers, every_s
        self.series: list[dict] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        last_t, last_done = time.monotonic(), self.tally.num_done
        while not self.stopping.wait(self.every_s):
            try:
                sample = snapshot(self.pid, self.url, self.headers)
            except (OSError, httpx.HTTPError) as e:  # the server died: the report says so
                self.series.append({"t": self.elapsed(), "error": str(e)})
                return
            now, done = time.monotonic(), self.tally.num_done
            sample["answers_per_s"] = round((done - last_done) / (now - last_t), 2)
            sample["statuses"] = self.tally.statuses()
            self.series.append({"t": self.elapsed(), **sample})
            last_t, last_done = now, done

    def elapsed(self) -> float:
        return round(time.monotonic() - self.tally.start, 1)

    def stop(self) -> list[dict]:
        self.stopping.set()
        self.join()
        return self.series


def drift(series: list[dict], window_s: float) -> dict[str, dict]:
    """Each series' mean over its first `window_s` seconds against its last: the change
    absolute and relative (first window: from the first sample on)."""
    rows = [s for s in series if "error" not in s]
    if not rows:
        return {}
    end = rows[-1]["t"]
    first = [s for s in rows if s["t"] <= rows[0]["t"] + window_s]
    last = [s for s in rows if s["t"] >= end - window_s]
    out = {}
    for name in SERIES:
        a = statistics.fmean(s[name] for s in first)
        b = statistics.fmean(s[name] for s in last)
        out[name] = {
            "first": round(a, 2),
            "last": round(b, 2),
            "change": round(b - a, 2),
            "relative": round((b - a) / a, 4) if a else None,
        }
    return out


def drift_window(duration_s: float) -> float:
    """5 minutes at each end, or a fifth of a shorter run (under 25 minutes)."""
    return 300.0 if duration_s >= 1500 else duration_s / 5


def idle_check(
    pid: int, url: str, baseline: dict, headers=None, rss_tolerance=0.05, fd_slack=2
) -> dict:
    """Once the server is idle: every KV block free, RSS within `rss_tolerance` (a fraction)
    of `baseline` (the post-warm-up snapshot), descriptors within `fd_slack` of it."""
    m = wait_idle(url, headers)
    now = snapshot(pid, url, headers)
    rss_change = (now["rss_mb"] - baseline["rss_mb"]) / baseline["rss_mb"]
    checks = {
        "kv_blocks_free": m.get("lmengine_kv_blocks_used", -1) == 0,
        "rss_within": abs(rss_change) <= rss_tolerance,
        "fds_within": now["num_fds"] - baseline["num_fds"] <= fd_slack,
    }
    return {"after_warmup": baseline, "idle": now, "rss_change": round(rss_change, 4),
            "checks": checks, "passed": all(checks.values())}  # fmt: skip
