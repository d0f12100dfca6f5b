"""Engine behaviour: concurrency from real threads, bad input, cancel/end, stop conditions,
and what callers see when the loop dies."""

from __future__ import annotations

import threading
import time

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import random_prompts, run_threads


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    eng = Engine.from_pretrained(
        tiny_llama_path, EngineConfig(num_gpu_blocks=256, block_size=8, session_len=200)
    )
    yield eng
    eng.close()


def test_8_threads_x_8_requests_equal_one_at_a_time(engine):
    vocab = engine.info.vocab_size
    lengths = [(7 * i) % 50 + 1 for i in range(64)]
    prompts = random_prompts(lengths, vocab, seed=11)
    gen = GenerationConfig(max_new_tokens=10)
    inst = engine.create_instance()
    sequential = [inst.infer(1000 + i, p, gen_config=gen).token_ids for i, p in enumerate(prompts)]
    concurrent = run_threads(engine, prompts, gen, num_threads=8)
    assert [r.token_ids for r in concurrent] == sequential
    engine.check_integrity()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


BAD_INPUTS = [
    ("too long", dict(input_ids=[5] * 200), "session_len"),
    ("empty", dict(input_ids=[]), "empty prompt"),
    ("out of vocab", dict(input_ids=[5, 10**9]), "outside the vocabulary"),
    ("negative id", dict(input_ids=[-1]), "outside the vocabulary"),
    ("not ints", dict(input_ids=["a", "b"]), "list of integer"),
    ("unknown adapter", dict(input_ids=[5], adapter_name="nope"), "unknown adapter"),
    ("bad priority", dict(input_ids=[5], priority="high"), "priority"),
]


@pytest.mark.parametrize("name,kwargs,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_errors_and_engine_lives_on(engine, name, kwargs, message):
    inst = engine.create_instance()
    ids = kwargs.pop("input_ids")
    r = inst.infer(7, ids, gen_config=GenerationConfig(max_new_tokens=4), **kwargs)
    assert r.finish_reason == "error" and message in r.error
    ok = inst.infer(8, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=4))
    assert ok.finish_reason in ("stop", "length") and ok.generate_token_len >= 1
    engine.check_integrity()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_invalid_sampling_values_error(engine):
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1.0)
    cfg = GenerationConfig(do_sample=True)
    cfg.top_p = 3.0  # mutated after validation: the engine checks again
    r = engine.create_instance().infer(9, [5, 6], gen_config=cfg)
    assert r.finish_reason == "error" and "top_p" in r.error
    r = engine.create_instance().infer(9, [5, 6], gen_config={"max_new_tokens": 3})
    assert r.finish_reason == "error" and "GenerationConfig" in r.error


def test_mix_of_finished_cancelled_failed_leaves_every_block_free(engine):
    inst = engine.create_instance()
    long_gen = GenerationConfig(max_new_tokens=150, ignore_eos=True)
    streams = [inst.stream_infer(100 + i, [5 + i] * 20, gen_config=long_gen) for i in range(4)]
    firsts = [next(s) for s in streams]  # all four are running
    assert all(f.finish_reason is None for f in firsts)
    inst.cancel(100)
    inst.end(101)
    streams[2].close()  # closing the iterator cancels too
    bad = inst.infer(104, [], gen_config=long_gen)
    last = [r for r in streams[0]][-1]
    assert last.finish_reason == "cancel"
    assert [r for r in streams[1]][-1].finish_reason == "cancel"
    assert bad.finish_reason == "error"
    final = [r for r in streams[3]][-1]
    assert final.finish_reason == "length" and final.generate_token_len == 150
    deadline = time.time() + 10
    while engine.stats()["num_running"] and time.time() < deadline:
        time.sleep(0.05)
    engine.check_integrity()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_busy_session_is_an_error(engine):
    inst = engine.create_instance()
    gen = GenerationConfig(max_new_tokens=100, ignore_eos=True)
    stream = inst.stream_infer(300, [5] * 10, gen_config=gen)
    next(stream)
    r = inst.infer(300, [6] * 5, gen_config=gen)
    assert r.finish_reason == "error" and "already has a running request" in r.error
    stream.close()


def test_stop_token_ids_and_max_new_tokens(engine):
    inst = engine.create_instance()
    p = random_prompts([12], engine.info.vocab_size, seed=21)[0]
    free = inst.infer(400, p, gen_config=GenerationConfig(max_new_tokens=12, ignore_eos=True))
    assert free.finish_reason == "length" and free.generate_token_len == 12
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    r = inst.infer(400, p, gen_config=GenerationConfig(max_new_tokens=12, stop_token_ids=[stop_at]))
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[: first + 1]
    assert r.stop_reason == stop_at  # vLLM's stop_reason: the id that ended it
    assert free.stop_reason is None  # a length is no stop
    r = inst.infer(
        400,
        p,
        gen_config=GenerationConfig(max_new_tokens=12, stop_token_ids=[stop_at], min_new_tokens=8),
    )
    assert r.generate_token_len >= 8


def test_stop_words_cut_the_text(engine):
    inst = engine.create_instance()
    p = random_prompts([12], engine.info.vocab_size, seed=22)[0]
    free = inst.infer(500, p, gen_config=GenerationConfig(max_new_tokens=20, ignore_eos=True))
    word = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert word
    cut = free.text.index(word)
    responses = list(
        inst.stream_infer(500, p, gen_config=GenerationConfig(max_new_tokens=20, stop_words=[word]))
    )
    final = responses[-1]
    assert final.finish_reason == "stop" and final.text == free.text[:cut]
    assert final.stop_reason == word
    # streamed text never shows any part of the stop word it will cut
    for r in responses:
        assert final.text.startswith(r.text)


def test_session_len_caps_generation(engine):
    r = engine.create_instance().infer(
        600, [5] * 190, gen_config=GenerationConfig(max_new_tokens=100, ignore_eos=True)
    )
    assert r.finish_reason == "length" and r.input_token_len + r.generate_token_len == 200


def test_failed_step_fails_its_requests_and_engine_lives_on(engine):
    inst = engine.create_instance()
    real_execute = engine.model_agent.execute
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    running = inst.stream_infer(400, [5] * 12, gen_config=gen)
    assert next(running).finish_reason is None

    def explode_once(out):
        engine.model_agent.execute = real_execute
        raise RuntimeError("injected failure")

    engine.model_agent.execute = explode_once
    last = [r for r in running][-1]
    assert last.finish_reason == "error" and "injected failure" in last.error
    assert 1 <= last.generate_token_len < 40  # the tokens it had before the failure
    ok = inst.infer(401, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=4))
    assert ok.finish_reason in ("stop", "length") and ok.error is None
    assert engine.is_alive
    engine.check_integrity()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_loop_death_reaches_every_caller(tiny_llama_path):
    eng = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=64))

    def explode(out):
        raise RuntimeError("injected failure")

    eng.model_agent.execute = explode  # every step fails: the loop gives up after a few
    inst = eng.create_instance()
    results = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(
                inst.infer(i, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=3))
            )
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4
    assert all(r.finish_reason == "error" and "injected failure" in r.error for r in results)
    for i in range(10, 20):  # one request per step until the engine stops trying
        late = inst.infer(i, [5], gen_config=GenerationConfig(max_new_tokens=2))
        assert late.finish_reason == "error"
        if "engine loop died" in late.error:
            break
    # NOTE: the step that gives up fails its own requests first ("injected failure"), then the
    # loop stops; every request after that is refused with the loop's death
    assert "engine loop died" in late.error and "injected failure" in late.error
    eng._thread.join(timeout=30)
    assert not eng.is_alive
    eng.close()


def test_close_fails_outstanding_requests(tiny_llama_path):
    eng = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=64))
    stream = eng.create_instance().stream_infer(
        1, [5] * 4, gen_config=GenerationConfig(max_new_tokens=400, ignore_eos=True)
    )
    next(stream)
    eng.close()
    last = [r for r in stream][-1]
    assert last.finish_reason == "error" and "closed" in last.error


def test_load_failure_raises_in_the_caller(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Engine.from_pretrained(str(tmp_path / "missing" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine.from_pretrained(str(tmp_path / "empty"))


def test_step_observers_see_every_step(tiny_llama_path):
    """An observer gets one report per step on the loop thread: what ran, by request, the
    requests taken in and ended; one that raises is dropped and the engine goes on."""
    reports, threads = [], set()

    def observe(report):
        threads.add(threading.current_thread().name)
        reports.append((report, report.counters["num_running"]))

    def broken(report):
        raise RuntimeError("observer bug")

    with Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=64)) as eng:
        eng.add_observer(observe)
        eng.add_observer(broken)
        out = eng.create_instance().infer(
            7, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=5, ignore_eos=True)
        )
        assert out.finish_reason == "length" and len(out.token_ids) == 5
        eng.remove_observer(observe)
        again = eng.create_instance().infer(
            8, [5, 6], gen_config=GenerationConfig(max_new_tokens=2)
        )
        assert again.error is None
    assert threads == {"lmengine-loop"}
    steps = [r for r, _ in reports]
    assert [r.step for r in steps] == list(range(steps[0].step, steps[0].step + 5))
    assert steps[0].added == [7] and steps[-1].ended == [7]
    assert steps[0].scheduled[0].request_id == 7 and steps[0].num_prefill_tokens == 3
    assert [r.scheduled[0].num_generated_tokens for r in steps] == [1, 2, 3, 4, 5]
    assert all(r.num_batched_tokens == sum(w.num_new_tokens for w in r.scheduled) for r in steps)
    assert all(r.error is None and r.seconds > 0 for r in steps)
    assert [n for _, n in reports] == [1, 1, 1, 1, 0]


def test_client_builds_checks_streams_and_cancels(tiny_llama_path):
    """The front door: a request is built with a fresh id, checked once (a bad one raises
    before it is queued), streamed delta by delta, and cancelled by closing its stream."""
    from lmengine.engine.request import RequestError

    with Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=64)) as eng:
        client = eng.client
        with pytest.raises(RequestError, match="token id"):
            client.check(client.request([10**9], GenerationConfig(max_new_tokens=2)))
        req = client.request([5, 6, 7], GenerationConfig(max_new_tokens=4, ignore_eos=True))
        other = client.request([5, 6, 7])
        assert req.request_id != other.request_id
        client.check(req)
        assert req.validated
        deltas = list(client.stream(req))
        assert [len(d.token_ids) for d in deltas] == [1, 1, 1, 1]
        assert deltas[-1].finish_reason == "length" and deltas[-1].request_id == req.request_id
        long = client.request([5, 6], GenerationConfig(max_new_tokens=500, ignore_eos=True))
        stream = client.stream(long)
        next(stream)
        stream.close()  # cancels: its blocks come back
        deadline = time.monotonic() + 30
        while eng.stats()["num_running"] + eng.stats()["num_waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        eng.check_integrity()
        assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]
