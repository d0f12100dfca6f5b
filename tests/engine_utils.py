"""Helpers to drive an Engine from real threads in tests."""

from __future__ import annotations

import random
import threading
import time

from lmengine import Engine, GenerationConfig, Response


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_threads(
    engine: Engine,
    prompts: list[list[int]],
    gen_config: GenerationConfig | list[GenerationConfig],
    num_threads: int | None = None,
    stagger_s: float = 0.0,
) -> list[Response]:
    """Submit every prompt from `num_threads` threads (default: one per prompt), thread t
    starting after t * stagger_s; each thread runs its prompts one after another."""
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
            for i in range(t, len(prompts), num_threads):
                results[i] = inst.infer(i, prompts[i], gen_config=configs[i])
        except BaseException as e:  # surfaced below, in the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=600)
    if errors:
        raise errors[0]
    assert all(r is not None for r in results), "a request never finished"
    return results
