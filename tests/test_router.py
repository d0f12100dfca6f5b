"""Replicas behind an existing router, as docs/replicas.md tells a user to run them:
two `lmengine serve` processes and SGLang's model gateway (`smg`, from PyPI) on loopback ports,
the `openai` client pointed at the router. 64 requests all succeed and both replicas serve
some (read from their /metrics); with the cache-aware policy, requests sharing a long prefix
go to one replica; one replica killed mid-run, the requests still to come are served by the
other and nothing hangs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from benchmarks.serving import start_smg, stop
from tests.test_server import metrics, start_server, stop_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def replicas(tiny_llama_path):
    procs = []
    for _ in range(2):
        procs.append(
            start_server(
                tiny_llama_path,
                "--served-model-name",
                MODEL,
                "--num-threads",
                "1",
                "--block-size",
                "4",
                "--num-gpu-blocks",
                "256",
                "--enable-prefix-caching",
            )  # fmt: skip
        )
    yield procs
    for proc, _ in procs:
        if proc.poll() is None:
            stop_server(proc)


def served(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("lmengine_requests_total{"))


def complete(client: openai.OpenAI, i: int, prefix: str = "") -> str:
    r = client.completions.create(
        model=MODEL, prompt=f"{prefix}request {i}", max_tokens=4, temperature=0
    )
    return r.choices[0].finish_reason


def test_cache_aware_policy_keeps_a_shared_prefix_on_one_replica(replicas):
    urls = [url for proc, url in replicas if proc.poll() is None]
    router, url = start_smg(urls, "cache_aware")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        prefix = "You are a careful assistant who answers in one short sentence. " * 4
        before = [served(u) for u in urls]
        for i in range(12):
            assert complete(client, i, prefix) == "length"
        counts = [served(u) - b for u, b in zip(urls, before)]
        assert sorted(counts) == [0, 12], counts
    finally:
        stop(router)


def test_requests_spread_over_replicas_and_survive_a_dead_one(replicas):
    urls = [url for _, url in replicas]
    router, url = start_smg(urls, "round_robin")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        before = [served(u) for u in urls]
        with ThreadPoolExecutor(8) as pool:
            reasons = list(pool.map(lambda i: complete(client, i), range(64)))
        assert reasons == ["length"] * 64
        counts = [served(u) - b for u, b in zip(urls, before)]
        assert sum(counts) == 64 and min(counts) > 0, counts
        # streamed through the router too
        chunks = client.completions.create(
            model=MODEL, prompt="stream me", max_tokens=6, temperature=0, stream=True
        )
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1

        # one replica dies while requests keep coming: they all succeed on the other
        dead, alive = replicas[0][0], urls[1]
        before_alive = served(alive)
        with ThreadPoolExecutor(4) as pool:
            futures = []
            for i in range(32):
                if i == 8:
                    dead.kill()
                    dead.wait()
                futures.append(pool.submit(complete, client, i))
                time.sleep(0.05)
            reasons = [f.result(timeout=120) for f in futures]
        assert reasons == ["length"] * 32
        assert served(alive) - before_alive >= 24
    finally:
        stop(router)
