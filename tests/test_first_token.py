"""A request that arrives while the engine is busy decoding gets its first token within two
steps: the step running when it arrives, and the next one, where it is prefilled alongside
the running decodes. Counted in the engine's steps (RequestMetrics), never in seconds."""

from __future__ import annotations

import threading

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import random_prompts

BUSY = 6  # requests decoding when the newcomers arrive
BUSY_TOKENS = 400  # long enough to still be decoding when the newcomers have their tokens


def _start_busy(engine: Engine, prompts: list[list[int]]) -> tuple[list, threading.Event]:
    """Stream `prompts` from one thread each; returns their final Responses (filled when
    they end) and an event set once every one of them has generated a few tokens."""
    finals: list = [None] * len(prompts)
    decoding = threading.Barrier(len(prompts) + 1)
    gen = GenerationConfig(max_new_tokens=BUSY_TOKENS, ignore_eos=True)

    def run(i: int) -> None:
        inst = engine.create_instance()
        for resp in inst.stream_infer(1000 + i, prompts[i], gen_config=gen):
            if resp.generate_token_len == 3:
                decoding.wait(timeout=60)
            finals[i] = resp

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    decoding.wait(timeout=60)
    return finals, threads


def _first_response(engine: Engine, session_id: int, prompt: list[int], **kwargs):
    inst = engine.create_instance()
    stream = inst.stream_infer(session_id, prompt, **kwargs)
    first = next(stream)
    stream.close()  # cancels the rest
    return first


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"scheduling_policy": "priority"},
        {"scheduling_policy": "sjf"},
        {"max_prefill_token_num": 256},  # the newcomers' prompts still fit one step's budget
    ],
    ids=["fcfs", "priority", "sjf", "small-budget"],
)
def test_arrival_during_decoding_gets_its_first_token_within_two_steps(tiny_llama_path, config):
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=512, **config))
    try:
        vocab = engine.model_agent.info.vocab_size
        busy = random_prompts([20, 35, 50, 8, 64, 12], vocab, seed=1)
        newcomers = random_prompts([40, 90, 17, 60], vocab, seed=2)
        finals, threads = _start_busy(engine, busy)
        gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
        firsts = [None] * len(newcomers)

        def arrive(i: int) -> None:
            firsts[i] = _first_response(engine, 2000 + i, newcomers[i], gen_config=gen)

        # one alone, then three at once
        arrive(0)
        together = [threading.Thread(target=arrive, args=(i,)) for i in (1, 2, 3)]
        for th in together:
            th.start()
        for th in together:
            th.join(timeout=60)
        steps_when_done = engine.stats()["num_steps"]
        for th in threads:
            th.join(timeout=120)

        for i, first in enumerate(firsts):
            assert first.generate_token_len == 1, first.error
            m = first.metrics
            assert m.first_token_step is not None and m.submit_step >= 1, m
            assert m.steps_to_first_token <= 2, f"newcomer {i}: {m}"
            assert m.first_scheduled_step == m.first_token_step  # one prefill chunk
            assert m.submit_time <= m.arrival_time <= m.first_scheduled_time
            assert m.first_scheduled_time < m.first_token_time
        # the busy requests were decoding throughout: they ran on well after the newcomers
        assert all(r.generate_token_len == BUSY_TOKENS for r in finals)
        assert all(r.metrics.first_token_step < firsts[0].metrics.submit_step for r in finals)
        assert engine.stats()["num_steps"] > steps_when_done
        engine.check_integrity()
    finally:
        engine.close()


def test_a_prompt_beyond_the_budget_takes_one_step_per_chunk(tiny_llama_path):
    """The bound is the budget's: a prompt of three chunks has its first token three steps
    after it is first scheduled."""
    engine = Engine.from_pretrained(
        tiny_llama_path, EngineConfig(num_gpu_blocks=512, max_prefill_token_num=32)
    )
    try:
        vocab = engine.model_agent.info.vocab_size
        finals, threads = _start_busy(engine, random_prompts([10, 20], vocab, seed=3))
        prompt = random_prompts([80], vocab, seed=4)[0]
        first = _first_response(engine, 7, prompt, gen_config=GenerationConfig(max_new_tokens=2))
        for th in threads:
            th.join(timeout=120)
        m = first.metrics
        assert m.first_token_step - m.first_scheduled_step == 2, m  # chunks of 32, 32, 16
        assert m.first_scheduled_step - m.submit_step <= 1, m
    finally:
        engine.close()
