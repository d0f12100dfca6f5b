"""A fault in any stage of a step fails exactly that step's requests and nothing else.

Each case patches one stage of the step (scheduling, the forward, sampling, output processing,
detokenization, the scheduler's update, beam selection, publishing) to raise once, while
several threads wait on their requests with a timeout. Every call must come back within
seconds; the requests of the failing step end with finish_reason "error" and the step-failure
message, every other request completes; afterwards no KV block is held, the scheduler's
bookkeeping is consistent, and a new request is served. For plain, beam-search and
speculative requests, and with tensor parallelism.
"""

from __future__ import annotations

import threading
import time

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine.detokenize import IncrementalDetokenizer
from lmengine.engine.request import STEP_FAILED
from tests.engine_utils import random_prompts

TIMEOUT_S = 60  # a generous bound on 2 busy cores; a hang would wait forever


class Fault:
    """Makes `owner.name` raise on its `at`-th call (once), or on the first call whose
    arguments satisfy `when`, and records which sessions the step that raised was running."""

    def __init__(self, engine: Engine, owner, name: str, at: int = 1, when=None) -> None:
        self.engine, self.at, self.when, self.calls = engine, at, when, 0
        self.sessions: set[int] | None = None  # the failing step's sessions
        self.real = getattr(owner, name)
        self._last_out = None
        real_schedule = engine.scheduler.schedule

        def schedule():
            self._last_out = real_schedule()
            return self._last_out

        def faulty(*args, **kwargs):
            self.calls += 1
            due = self.calls >= self.at if self.when is None else self.when(*args)
            if self.sessions is None and due:
                if name == "schedule":  # nothing scheduled yet: every live request fails
                    self.sessions = set(engine.requests)
                else:
                    self.sessions = set(self._last_out.request_ids)
                raise RuntimeError(f"injected fault in {name}")
            return self.real(*args, **kwargs)

        if name != "schedule":
            engine.scheduler.schedule = schedule
            self.restore_schedule = lambda: setattr(engine.scheduler, "schedule", real_schedule)
        else:
            self.restore_schedule = lambda: None
        self.owner, self.name = owner, name
        setattr(owner, name, faulty)

    def remove(self) -> None:
        self.restore_schedule()
        if isinstance(self.owner, type):
            setattr(self.owner, self.name, self.real)
        else:
            delattr(self.owner, self.name)  # the instance attribute hid the class's method


def _run(engine: Engine, prompts: list[list[int]], configs: list[GenerationConfig]) -> dict:
    """Each prompt from its own thread (session id = index); returns session -> Response."""
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(prompts))

    def work(i: int) -> None:
        barrier.wait(timeout=TIMEOUT_S)
        results[i] = engine.create_instance().infer(i, prompts[i], gen_config=configs[i])

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a caller was left waiting"
    return results


def _check(engine: Engine, fault: Fault, results: dict, num: int) -> None:
    assert fault.sessions, "the fault never fired"
    assert len(results) == num
    failed = {i for i, r in results.items() if r.finish_reason == "error"}
    assert failed == fault.sessions, (failed, fault.sessions)
    for i in failed:
        assert results[i].error.startswith(STEP_FAILED), results[i].error
        assert "injected fault" in results[i].error
    for i in set(results) - failed:
        assert results[i].finish_reason in ("stop", "length") and results[i].error is None
    engine.check_integrity()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
    after = engine.create_instance().infer(
        10_000, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=4)
    )
    assert after.finish_reason in ("stop", "length") and after.error is None
    assert engine.is_alive


def _stage(engine: Engine, stage: str, at: int) -> Fault:
    """A fault in one stage of a step. The update and publishing faults fire in a step where a
    request finishes: the case where a finished request's state must outlive the failure."""
    owner, name = {
        "schedule": (engine.scheduler, "schedule"),
        "forward": (engine.model_agent.runner, "run"),
        "sampling": (engine.model_agent, "sample"),
        "verify": (engine.model_agent.verifier, "verify"),
        "outputs": (engine.output_stage, "process"),
        "detokenize": (IncrementalDetokenizer, "add"),
        "update": (engine.scheduler, "update"),
        "beams": (engine.beam_search, "advance"),
        "publish": (engine.request_manager, "publish_many"),
    }[stage]
    when = None
    if stage == "update":
        when = lambda out, new_tokens, finished: bool(finished)  # noqa: E731
    elif stage == "publish":
        when = lambda pairs: any(r.finish_reason for _, r in pairs)  # noqa: E731
    return Fault(engine, owner, name, at, when)


def _fault_case(engine: Engine, stage: str, at: int, prompts, configs) -> dict:
    """Run the prompts with a fault in `stage`, check the outcome; returns the Responses."""
    fault = _stage(engine, stage, at=at)
    try:
        results = _run(engine, prompts, configs)
    finally:
        fault.remove()
    _check(engine, fault, results, len(prompts))
    return results


STAGES = ["schedule", "forward", "sampling", "outputs", "detokenize", "update", "publish"]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    # a small pool: requests queue and get preempted, so a failing step leaves others behind
    eng = Engine.from_pretrained(
        tiny_llama_path, EngineConfig(block_size=4, num_gpu_blocks=40, max_batch_size=4)
    )
    yield eng
    eng.close()


@pytest.mark.parametrize("stage", STAGES)
def test_plain_requests(engine, stage):
    prompts = random_prompts([5, 9, 14, 3, 7, 11], 1000, seed=1)
    configs = [GenerationConfig(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    _fault_case(engine, stage, 4, prompts, configs)


@pytest.mark.parametrize("stage", [*STAGES, "beams"])
def test_beam_requests(engine, stage):
    """Two beam groups and two plain requests side by side; a group fails as a whole."""
    prompts = random_prompts([6, 10, 4, 8], 1000, seed=2)
    beam = GenerationConfig(max_new_tokens=6, num_beams=3, ignore_eos=True)
    plain = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    configs = [beam, plain, beam, plain]
    # detokenization of a beam request happens once, when its group is done
    at = 1 if stage in ("detokenize", "beams") else 3
    results = _fault_case(engine, stage, at, prompts, configs)
    ok = [i for i, r in results.items() if r.finish_reason != "error" and configs[i] is beam]
    for i in ok:
        assert len(results[i].beam_token_ids) == 1 and results[i].beam_scores


@pytest.fixture(scope="module")
def spec_engine(tiny_llama_path):
    # the model as its own draft model: every decode step drafts (and keeps most drafts)
    speculative = {"method": "draft_model", "draft_model": tiny_llama_path}
    eng = Engine.from_pretrained(
        tiny_llama_path,
        EngineConfig(block_size=4, num_gpu_blocks=60, max_batch_size=4, speculative=speculative),
    )
    yield eng
    eng.close()


@pytest.mark.parametrize("stage", [*STAGES, "verify"])
def test_speculative_requests(spec_engine, stage):
    eng = spec_engine
    prompts = random_prompts([8, 13, 5, 10], 1000, seed=4)
    configs = [GenerationConfig(max_new_tokens=14, ignore_eos=True) for _ in prompts]
    _fault_case(eng, stage, 4, prompts, configs)
    assert eng.stats()["speculative"]["num_draft_tokens"] > 0


@pytest.mark.slow
def test_tensor_parallel_sampling_fault_is_contained_forward_fault_is_fatal(tiny_llama_path):
    """With tp=2 a fault after the forward (sampling, outputs) is contained like with tp=1;
    a fault inside the broadcast step stops the engine, and every caller gets an error."""
    eng = Engine.from_pretrained(
        tiny_llama_path, EngineConfig(tp=2, device="cpu", block_size=4, num_gpu_blocks=40)
    )
    procs = list(eng.model_agent.workers.procs.values())
    try:
        prompts = random_prompts([5, 9, 4], 1000, seed=3)
        configs = [GenerationConfig(max_new_tokens=8, ignore_eos=True) for _ in prompts]
        fault = Fault(eng, eng.model_agent, "sample", at=3)
        try:
            results = _run(eng, prompts, configs)
        finally:
            fault.remove()
        _check(eng, fault, results, len(prompts))
        Fault(eng, eng.model_agent.runner, "prepare", at=2)  # rank 0 fails mid-step
        results = _run(eng, prompts, configs)
        assert all(r.finish_reason == "error" for r in results.values())
        assert any("tensor-parallel step failed" in r.error for r in results.values())
        late = eng.create_instance().infer(
            99, [5, 6], gen_config=GenerationConfig(max_new_tokens=2)
        )
        assert late.finish_reason == "error"
        deadline = time.monotonic() + 30  # the loop stops the workers on its way out
        while eng.is_alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not eng.is_alive
    finally:
        eng.close()
    for proc in procs:  # killed: a worker stuck in a collective never gets a stop message
        assert proc.wait(timeout=10) != 0
