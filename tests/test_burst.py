"""A burst of requests arriving together at an idle engine starts in one step: the first
step waits while a front door still prepares requests it has received (announced with
`Client.expect_arrival`), or while requests keep coming less than `burst_gap_ms` apart, for
`burst_wait_ms` at most and no longer once the waiting prompts fill a step. Counted in the
engine's steps (RequestMetrics), never in seconds; the server announces every POST from its
arrival until its job is submitted or its response ends."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine.request import RequestManager
from lmengine.serve.app import ServerSettings, build_app
from lmengine.serve.limits import BodyLimit
from lmengine.serve.metrics import ServerMetrics
from tests.engine_utils import random_prompts

GEN = GenerationConfig(max_new_tokens=2, ignore_eos=True)
FOREVER_MS = 600_000.0  # a cap no test reaches: what ends the wait is the rule under test


def _run(engine: Engine, session_id: int, prompt: list[int], out: dict) -> threading.Thread:
    """Stream `prompt` in a thread of its own; its final Response lands in out[session_id]."""

    def run() -> None:
        inst = engine.create_instance()
        for resp in inst.stream_infer(session_id, prompt, gen_config=GEN):
            out[session_id] = resp

    th = threading.Thread(target=run)
    th.start()
    return th


def _wait_for_pending(engine: Engine, num: int) -> None:
    """Until `num` requests have been taken by the loop or sit in its inbox."""
    deadline = time.monotonic() + 60
    while len(engine.requests) + engine.request_manager.num_pending() < num:
        assert time.monotonic() < deadline, f"fewer than {num} requests reached the engine"
        time.sleep(0.001)


def test_an_announced_arrival_joins_the_idle_engines_first_step(tiny_llama_path):
    engine = Engine.from_pretrained(
        tiny_llama_path, EngineConfig(num_gpu_blocks=256, burst_wait_ms=FOREVER_MS)
    )
    try:
        a, b = random_prompts([30, 20], engine.model_agent.info.vocab_size, seed=5)
        steps_before = engine.stats()["num_steps"]
        arrived = engine.client.expect_arrival()  # b is still being "tokenized"
        out: dict = {}
        first = _run(engine, 1, a, out)
        _wait_for_pending(engine, 1)
        assert engine.stats()["num_steps"] == steps_before  # a waits for b
        second = _run(engine, 2, b, out)
        _wait_for_pending(engine, 2)
        arrived()
        arrived()  # once, however often called
        first.join(timeout=120)
        second.join(timeout=120)
        assert engine.request_manager.num_arriving() == 0
        ma, mb = out[1].metrics, out[2].metrics
        assert out[1].generate_token_len == out[2].generate_token_len == 2
        assert ma.first_scheduled_step == mb.first_scheduled_step == steps_before + 1
        engine.check_integrity()
    finally:
        engine.close()


def test_requests_close_together_join_one_step_until_the_budget_is_full(tiny_llama_path):
    """Once two requests wait, further ones keep the first step waiting while they come
    (with a gap no test reaches) until a step's budget is full: three prompts of 30 tokens
    against a budget of 64, the third one's first chunk in the same step."""
    engine = Engine.from_pretrained(
        tiny_llama_path,
        EngineConfig(
            num_gpu_blocks=256,
            max_prefill_token_num=64,
            burst_wait_ms=FOREVER_MS,
            burst_gap_ms=FOREVER_MS,
        ),
    )
    try:
        prompts = random_prompts([30, 30, 30], engine.model_agent.info.vocab_size, seed=6)
        steps_before = engine.stats()["num_steps"]
        arrived = engine.client.expect_arrival()
        out: dict = {}
        threads = [_run(engine, 1, prompts[0], out), _run(engine, 2, prompts[1], out)]
        _wait_for_pending(engine, 2)
        arrived()  # nothing announced now: two wait, so the gap keeps the step waiting
        assert engine.stats()["num_steps"] == steps_before
        threads.append(_run(engine, 3, prompts[2], out))
        for th in threads:
            th.join(timeout=120)
        for i in (1, 2, 3):
            assert out[i].generate_token_len == 2
            assert out[i].metrics.first_scheduled_step == steps_before + 1, i
        engine.check_integrity()
    finally:
        engine.close()


def test_a_lone_request_and_an_arrival_that_never_comes_do_not_hold_the_engine(
    tiny_llama_path,
):
    """A lone request runs at once, whatever the gap and the cap (here ones no test reaches:
    held, it would not finish within the join's timeout); an announcement never ended holds
    an idle engine's first step for `burst_wait_ms` only."""
    for wait_ms, announce in ((FOREVER_MS, False), (20.0, True)):
        engine = Engine.from_pretrained(
            tiny_llama_path,
            EngineConfig(num_gpu_blocks=256, burst_wait_ms=wait_ms, burst_gap_ms=FOREVER_MS),
        )
        try:
            (prompt,) = random_prompts([12], engine.model_agent.info.vocab_size, seed=7)
            if announce:
                engine.client.expect_arrival()  # never ended
            out: dict = {}
            _run(engine, 1, prompt, out).join(timeout=60)
            assert 1 in out and out[1].generate_token_len == 2, (wait_ms, announce)
            assert engine.request_manager.num_arriving() == int(announce)
            engine.check_integrity()
        finally:
            engine.close()


def test_closing_the_engine_ends_its_wait_for_a_burst(tiny_llama_path):
    """An engine closed while its first step waits for an announced arrival that never
    comes stops at once, not at `burst_wait_ms` (here one no test reaches); the request it
    held gets an error."""
    engine = Engine.from_pretrained(
        tiny_llama_path, EngineConfig(num_gpu_blocks=256, burst_wait_ms=FOREVER_MS)
    )
    (prompt,) = random_prompts([12], engine.model_agent.info.vocab_size, seed=8)
    engine.client.expect_arrival()  # never ended
    out: dict = {}
    held = _run(engine, 1, prompt, out)
    _wait_for_pending(engine, 1)
    closing = threading.Thread(target=engine.close)
    closing.start()
    closing.join(timeout=60)
    assert not closing.is_alive(), "close() waited out the burst"
    held.join(timeout=60)
    assert out[1].finish_reason == "error", out[1]


@pytest.mark.parametrize("value", [-1.0, float("nan")])
@pytest.mark.parametrize("field", ["burst_wait_ms", "burst_gap_ms"])
def test_burst_settings_must_be_non_negative(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_the_server_announces_each_post_until_it_is_submitted_or_answered():
    manager = RequestManager()
    seen: list[tuple[str, int]] = []

    async def app(scope, receive, send) -> None:
        seen.append((scope["method"], manager.num_arriving()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    door = BodyLimit(app, 0, ServerMetrics(), expect_arrival=manager.expect_arrival)

    async def call(method: str) -> None:
        scope = {"type": "http", "method": method, "path": "/", "headers": []}

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            pass

        await door(scope, receive, send)

    asyncio.run(call("POST"))
    asyncio.run(call("GET"))
    assert seen == [("POST", 1), ("GET", 0)]
    assert manager.num_arriving() == 0


def test_server_requests_leave_no_announcement_behind(tiny_llama_path):
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=256))
    with TestClient(build_app(engine, ServerSettings(model_name="tiny"))) as http:
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        bad = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -3})
        assert bad.status_code == 400, bad.text
        assert http.get("/health").status_code == 200
        assert engine.request_manager.num_arriving() == 0
