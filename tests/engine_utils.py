"""Helpers to drive an Engine from real threads in tests, and to probe a fresh process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext

from lmengine import Engine, GenerationConfig, Response
from lmengine.kernels import cpu_ext


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_threads(
    engine: Engine,
    prompts: list[list[int]],
    gen_config: GenerationConfig | list[GenerationConfig],
    num_threads: int | None = None,
    stagger_s: float = 0.0,
    together: bool = False,
) -> list[Response]:
    """Submit every prompt from `num_threads` threads (default: one per prompt), thread t
    starting after t * stagger_s; each thread runs its prompts one after another.

    together: the engine loop is held until every thread's first request is queued, so the
    first step sees all of them waiting (threads alone leave that to timing), queued in
    thread order (the order decides which fit in a small KV pool first)."""
    num_threads = num_threads or len(prompts)
    configs = gen_config if isinstance(gen_config, list) else [gen_config] * len(prompts)
    results: list[Response | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    start = threading.Barrier(num_threads)

    def work(t: int) -> None:
        try:
            start.wait(timeout=60)  # all threads ready: then stagger_s=0 means "at once"
            time.sleep(t * stagger_s)
            inst = engine.create_instance()
            if together:  # queued in thread order: after the t threads before this one
                deadline = time.monotonic() + 60
                while engine.request_manager.num_pending() < t:
                    assert time.monotonic() < deadline, "an earlier thread never queued"
                    time.sleep(0.0005)
            for i in range(t, len(prompts), num_threads):
                results[i] = inst.infer(i, prompts[i], gen_config=configs[i])
        except BaseException as e:  # surfaced below, in the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    with loop_held(engine, num_pending=num_threads) if together else nullcontext():
        for th in threads:
            th.start()
    for th in threads:
        th.join(timeout=600)
    if errors:
        raise errors[0]
    assert all(r is not None for r in results), "a request never finished"
    return results


@contextmanager
def loop_held(engine: Engine, num_pending: int, timeout_s: float = 60.0):
    """Keep the engine loop busy inside a call until `num_pending` requests wait in its
    inbox; the loop then takes them all in one drain."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(timeout_s)

    holder = threading.Thread(target=engine.call, args=(hold,))
    holder.start()
    try:
        assert entered.wait(timeout_s), "the engine loop never ran the holding call"
        yield
        deadline = time.monotonic() + timeout_s
        while engine.request_manager.num_pending() < num_pending:
            assert time.monotonic() < deadline, "the requests never reached the inbox"
            time.sleep(0.001)
    finally:
        release.set()
        holder.join(timeout_s)


def spy_compiled_ops(monkeypatch, names: list[str]) -> dict[str, list]:
    """From now on `cpu_ext.load()` (called per op) returns the compiled module with the ops
    `names` wrapped: each call's output is appended to the returned dict under the op's name,
    so the keys say which of them ran."""
    module = cpu_ext.load()
    assert module is not None, "the CPU kernels failed to build"
    outputs: dict[str, list] = {}

    class Spy:
        def __getattr__(self, attr):
            real = getattr(module, attr)
            if attr not in names:
                return real

            def recorded(*args, **kwargs):
                out = real(*args, **kwargs)
                outputs.setdefault(attr, []).append(out)
                return out

            return recorded

    monkeypatch.setattr(cpu_ext, "load", Spy)
    return outputs


def run_probe(code: str, *args: str, env: dict | None = None) -> dict:
    """Run `code` in a fresh Python (with `args` as its argv, `env` over this environment) and
    return the JSON object its last line of output prints."""
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])
