"""Policies and QoS through a real Engine (tiny random Llama): completion order of every policy
with max_batch_size=1, QoS user checks per request, QoS files checked at startup, stats."""

from __future__ import annotations

import json

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import random_prompts
from tests.test_qos import LMDEPLOY_SAMPLE
from tests.test_swap import final_responses, submit_at_once

# (prompt_len, max_new_tokens, priority) in arrival order
CASE = [(5, 9, 1), (12, 3, None), (2, 6, 4), (7, 3, 1), (9, 12, None)]
EXPECTED = {
    "fcfs": [0, 1, 2, 3, 4],
    "lcfs": [4, 3, 2, 1, 0],
    "priority": [2, 0, 3, 1, 4],
    "sjf": [1, 3, 2, 0, 4],
    "ldf": [1, 4, 3, 0, 2],
}


def record_finish_order(engine) -> list[int]:
    """Request ids in the order the scheduler finishes them (wraps `update`, loop thread)."""
    order: list[int] = []
    update = engine.scheduler.update

    def wrapped(out, new_tokens, finished=()):
        finished = list(finished)
        order.extend(s.request_id for s in finished)
        update(out, new_tokens, finished)

    engine.scheduler.update = wrapped
    return order


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_completion_order_follows_the_policy_with_batch_size_one(tiny_llama_path, policy):
    cfg = EngineConfig(max_batch_size=1, scheduling_policy=policy, num_gpu_blocks=64)
    engine = Engine.from_pretrained(tiny_llama_path, cfg)
    try:
        order = record_finish_order(engine)
        prompts = random_prompts([n for n, _, _ in CASE], engine.info.vocab_size, seed=3)
        gens = [GenerationConfig(max_new_tokens=m, ignore_eos=True) for _, m, _ in CASE]
        results = final_responses(
            submit_at_once(engine, prompts, gens, priorities=[p for _, _, p in CASE])
        )
        assert [r.generate_token_len for r in results] == [m for _, m, _ in CASE]
        assert order == EXPECTED[policy]
        engine.check_integrity()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def qos_engine(tiny_llama_path, tmp_path_factory):
    data = json.loads(json.dumps(LMDEPLOY_SAMPLE))
    for group in data["user_group_map"].values():  # no default entry anywhere
        group[:] = [e for e in group if e["id"] != "default"]
    path = tmp_path_factory.mktemp("qos") / "qos.json"
    path.write_text(json.dumps(data))
    cfg = EngineConfig(num_gpu_blocks=64, qos_config_path=str(path), eviction_type="swap")
    engine = Engine.from_pretrained(tiny_llama_path, cfg)
    yield engine
    engine.close()


def test_unknown_qos_user_is_a_request_error_and_the_engine_lives_on(qos_engine):
    inst = qos_engine.create_instance()
    gen = GenerationConfig(max_new_tokens=3)
    bad = inst.infer(1, [5, 6, 7], gen_config=gen, user_id="mallory")
    assert bad.finish_reason == "error" and "'mallory' is in no QoS user group" in bad.error
    ok = inst.infer(2, [5, 6, 7], gen_config=gen, user_id="user_id1")
    assert ok.finish_reason in ("stop", "length")
    stats = qos_engine.stats()
    gold = stats["qos"]["groups"]["Gold"]
    assert gold["num_served_tokens"] == 3 + ok.generate_token_len
    assert stats["qos"]["users"]["user_id1"]["num_served_tokens"] == gold["num_served_tokens"]
    assert stats["num_swapped"] == 0 and stats["num_waiting"] == 0
    qos_engine.check_integrity()


def test_pipeline_passes_one_qos_user_per_prompt(qos_engine):
    from lmengine.api import Pipeline

    pipe = Pipeline(qos_engine)  # NOTE: not closed: the module's engine is shared
    gen = GenerationConfig(max_new_tokens=2)
    bad, ok = pipe([[5, 6, 7], [5, 6, 8]], gen_config=gen, user_id=["mallory", "user_id1"])
    assert bad.finish_reason == "error" and "'mallory'" in bad.error
    assert ok.finish_reason == "length"
    with pytest.raises(ValueError, match="one entry per prompt"):
        pipe([[5, 6, 7], [5, 6, 8]], gen_config=gen, user_id=["user_id1"])
    qos_engine.check_integrity()


def test_malformed_qos_file_fails_at_startup_naming_the_field(tiny_llama_path, tmp_path):
    data = json.loads(json.dumps(LMDEPLOY_SAMPLE))
    data["user_group_map"]["Gold"][0]["quota_pct"] = "lots"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"user_group_map\.Gold\[0\]\.quota_pct"):
        Engine.from_pretrained(tiny_llama_path, EngineConfig(qos_config_path=str(path)))


def test_priority_aging_is_an_engine_config_field():
    assert EngineConfig(priority_aging_s=2.5).priority_aging_s == 2.5
    with pytest.raises(ValueError, match="priority_aging_s"):
        EngineConfig(priority_aging_s=-1)
