"""Crash-only with tensor parallelism, against a real `lmengine serve --tp 2`: SIGKILL of the
worker process while a stream and a whole request run (every request ends with a 503 within
seconds, /health turns 503, the server exits non-zero), and while the server is idle (the
same, without a request to see it)."""

from __future__ import annotations

import glob
import os
import signal
import time

from tests.test_server import httpx, server_output, start_server
from tests.test_server_uptime import check_crash_answers, run_until_the_engine_dies

TP_FLAGS = ("--tp", "2", "--device", "cpu", "--num-threads", "1", "--block-size", "4",
            "--num-gpu-blocks", "512")  # fmt: skip


def children(pid: int) -> list[int]:
    """The child processes of `pid` (every thread's: the engine thread starts the worker)."""
    kids = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def kill_worker(proc) -> None:
    (worker,) = children(proc.pid)
    os.kill(worker, signal.SIGKILL)


def test_worker_killed_mid_step_ends_requests_503_and_exits_nonzero(tiny_llama_path):
    proc, url = start_server(tiny_llama_path, *TP_FLAGS)
    try:
        seen = run_until_the_engine_dies(url, kill=lambda: kill_worker(proc))
        check_crash_answers(seen, proc)
        assert "worker rank 1 died" in seen["whole"][2]["error"]["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_killed_while_idle_turns_health_503_and_exits_nonzero(tiny_llama_path):
    proc, url = start_server(tiny_llama_path, *TP_FLAGS)
    try:
        kill_worker(proc)
        killed = time.monotonic()
        statuses = set()
        while proc.poll() is None and time.monotonic() < killed + 30:
            try:
                statuses.add(httpx.get(url + "/health", timeout=2).status_code)
            except httpx.HTTPError:  # the server has closed its port: exiting
                pass
            time.sleep(0.05)
        assert 503 in statuses and statuses <= {200, 503}, statuses  # 200: not noticed yet
        assert proc.wait(timeout=30) == 3, server_output(proc)
        assert time.monotonic() - killed < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
