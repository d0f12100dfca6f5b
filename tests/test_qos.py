"""QoS user groups without torch: the LMDeploy-QoS file format and its errors, strict priority
between groups, token shares within a group, Platinum admission under a saturating load."""

from __future__ import annotations

import json
import random

import pytest

from lmengine.scheduler import SequenceStatus
from lmengine.scheduler.qos import QoS, QoSConfig, QoSError
from tests.test_scheduler_swap import Clock, make_scheduler, make_seq

LMDEPLOY_SAMPLE = {
    "enable_user_qos": True,
    "user_groups": ["Platinum", "Gold", "Silver", "Bronze"],
    "user_group_map": {
        "Platinum": [{"id": "user_id0", "quota_pct": 100}, {"id": "default", "quota_pct": 0}],
        "Gold": [{"id": "user_id1", "quota_pct": 50}, {"id": "user_id2", "quota_pct": 50}],
        "Silver": [{"id": "user_id3", "quota_pct": 5}, {"id": "default", "quota_pct": 95}],
        "Bronze": [
            {"id": "user_id4", "quota_pct": 30},
            {"id": "user_id5", "quota_pct": 30},
            {"id": "user_id6", "quota_pct": 40},
            {"id": "default", "quota_pct": 0},
        ],
    },
}


def qos_of(groups: dict[str, list[tuple[str, float]]], **extra) -> QoS:
    data = {
        "enable_user_qos": True,
        "user_groups": list(groups),
        "user_group_map": {
            g: [{"id": u, "quota_pct": q} for u, q in users] for g, users in groups.items()
        },
        **extra,
    }
    return QoS(QoSConfig.from_dict(data))


# ---- the file --------------------------------------------------------------------------------
def test_lmdeploy_sample_file_loads(tmp_path):
    path = tmp_path / "qos.json"
    path.write_text(json.dumps(LMDEPLOY_SAMPLE))
    qos = QoS.from_file(str(path))
    t = qos.tenant("user_id5")
    assert (t.group_name, t.group, t.quota) == ("Bronze", 3, 0.3)
    # a user in no group goes to the default entry of the LAST group that has one
    assert qos.tenant("stranger").group_name == "Bronze" and qos.tenant(None).user == "default"


def test_quotas_are_normalised_and_enable_false_turns_qos_off(tmp_path):
    qos = qos_of({"G": [("a", 3), ("b", 1)]})
    assert qos.tenant("a").quota == 0.75 and qos.tenant("b").quota == 0.25
    path = tmp_path / "off.json"
    path.write_text(json.dumps({**LMDEPLOY_SAMPLE, "enable_user_qos": False}))
    assert QoS.from_file(str(path)) is None


def test_unknown_user_without_default_is_rejected():
    qos = qos_of({"Gold": [("a", 50), ("b", 50)]})
    with pytest.raises(QoSError, match="'zed' is in no QoS user group"):
        qos.tenant("zed")
    s = make_scheduler(qos=qos)
    with pytest.raises(QoSError):
        s.add_sequence(make_seq(0, 3, user_id="zed"))


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda d: d.pop("user_groups"), "user_groups"),
        (lambda d: d.update(enable_user_qos="yes"), "enable_user_qos"),
        (lambda d: d.update(user_group_map=[]), "user_group_map"),
        (lambda d: d["user_group_map"].update(Iron=[]), "user_group_map"),
        (lambda d: d["user_group_map"].pop("Gold"), "user_group_map.Gold"),
        (lambda d: d["user_group_map"]["Gold"][1].update(quota_pct="50"), "Gold[1].quota_pct"),
        (lambda d: d["user_group_map"]["Gold"][0].update(quota_pct=-1), "Gold[0].quota_pct"),
        (lambda d: d["user_group_map"]["Silver"][0].pop("id"), "Silver[0].id"),
        (lambda d: d["user_group_map"]["Silver"][0].update(id="user_id1"), "user_group_map.Silver"),
        (
            lambda d: d.update(user_groups=["Platinum", "Gold", "Silver", "Bronze", "Gold"]),
            "user_groups",
        ),
        (lambda d: d.update(window_s=0), "window_s"),
    ],
)
def test_malformed_file_names_the_field(tmp_path, change, field):
    data = json.loads(json.dumps(LMDEPLOY_SAMPLE))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="field") as err:
        QoS.from_file(str(path))
    assert field in str(err.value) and str(path) in str(err.value)


def test_unreadable_or_invalid_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        QoS.from_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        QoS.from_file(str(bad))


# ---- scheduling ------------------------------------------------------------------------------
def fake_run(s, steps, feed=None, limits=None, tick=0.1):
    """Run `steps` steps; `feed(step)` may add sequences; returns computed tokens per user and
    the admission step of every sequence."""
    served: dict[str, int] = {}
    admitted: dict[int, int] = {}
    for step in range(steps):
        if feed is not None:
            feed(step)
        out = s.schedule()
        for it in out.scheduled:
            served[it.seq.user_id] = served.get(it.seq.user_id, 0) + it.num_new_tokens
            admitted.setdefault(it.seq.seq_id, step)
        new = {it.seq.seq_id: 5 for it in out.scheduled if it.needs_sample}
        done = [
            it.seq
            for it in out.scheduled
            if it.needs_sample and it.seq.num_generated_tokens + 1 >= it.seq.max_new_tokens
        ]
        s.update(out, new, done)
        s.check_integrity()
        s.clock.t += tick
    return served, admitted


def test_higher_group_is_admitted_first_and_policy_orders_a_users_requests():
    qos = qos_of({"Platinum": [("p", 100)], "Gold": [("g", 100)], "Bronze": [("b", 100)]})
    s = make_scheduler(max_batch=1, qos=qos, policy="priority", clock=Clock())
    users = ["b", "b", "g", "b", "p", "g", "p"]
    prios = [0, 9, 0, 0, 1, 5, 2]
    for i, (u, p) in enumerate(zip(users, prios)):
        s.add_sequence(make_seq(i, 4, max_new=2, user_id=u, priority=p))
    _, admitted = fake_run(s, 40)
    order = sorted(admitted, key=admitted.get)
    # Platinum (priority 2 before 1), then Gold (5 before 0), then Bronze (9, then arrival)
    assert order == [6, 4, 5, 2, 1, 0, 3]


@pytest.mark.parametrize("quotas", [(75, 25), (50, 50), (90, 10)])
def test_two_backlogged_users_get_their_quota_of_served_tokens(quotas):
    qos = qos_of({"Gold": [("a", quotas[0]), ("b", quotas[1])]}, window_s=30)
    s = make_scheduler(num_blocks=256, max_batch=4, qos=qos, clock=Clock())
    rng = random.Random(0)
    counter = iter(range(10**6))

    def feed(step):  # both users always have 6 requests queued
        for user in ("a", "b"):
            while sum(q.user_id == user for q in s.waiting) < 6:
                n = next(counter)
                seq = make_seq(n, rng.randint(4, 24), max_new=rng.randint(4, 24), user_id=user)
                seq.arrival_time = s.clock.t
                s.add_sequence(seq)

    served, _ = fake_run(s, 600, feed)
    share_a = served["a"] / (served["a"] + served["b"])
    assert abs(share_a - quotas[0] / 100) <= 0.05, (served, share_a)


def test_absent_user_quota_goes_to_the_present_ones():
    qos = qos_of({"Gold": [("a", 25), ("b", 25), ("c", 50)]})
    s = make_scheduler(num_blocks=256, max_batch=4, qos=qos, clock=Clock())
    counter = iter(range(10**6))

    def feed(step):
        for user in ("a", "b"):  # c never sends anything
            while sum(q.user_id == user for q in s.waiting) < 4:
                s.add_sequence(make_seq(next(counter), 8, max_new=8, user_id=user))

    served, _ = fake_run(s, 300, feed)
    assert abs(served["a"] / (served["a"] + served["b"]) - 0.5) <= 0.05
    assert s.stats()["qos"]["users"]["c"]["num_served_tokens"] == 0


@pytest.mark.parametrize("batch_full", [False, True])
def test_platinum_waits_at_most_one_step_under_a_saturating_bronze_load(batch_full):
    qos = qos_of({"Platinum": [("vip", 100)], "Bronze": [("default", 100)]})
    max_batch = 4 if batch_full else 64
    s = make_scheduler(num_blocks=512, max_batch=max_batch, qos=qos, num_cpu_blocks=64)
    counter = iter(range(10**6))
    vip_added: dict[int, int] = {}

    def feed(step):
        while len(s.waiting) < 8:  # Bronze always has a backlog
            n = next(counter)
            s.add_sequence(make_seq(n, 6, max_new=30, user_id=f"bronze{n % 5}"))
        if step % 17 == 5:
            n = next(counter)
            s.add_sequence(make_seq(n, 6, max_new=4, user_id="vip"))
            vip_added[n] = step

    _, admitted = fake_run(s, 120, feed)
    assert len(vip_added) >= 6
    for n, step in vip_added.items():
        assert admitted[n] == step, f"vip request {n} waited {admitted[n] - step} steps"
    if batch_full:
        assert s.num_swap_outs > 0, "with a full batch the vip preempts a bronze request"


def test_lower_group_never_preempts_a_higher_one():
    qos = qos_of({"Gold": [("g", 100)], "Bronze": [("b", 100)]})
    s = make_scheduler(max_batch=1, qos=qos, num_cpu_blocks=16, policy="priority")
    gold = make_seq(0, 4, max_new=10, user_id="g", priority=0)
    s.add_sequence(gold)
    out = s.schedule()
    s.update(out, {0: 5})
    s.add_sequence(make_seq(1, 4, max_new=2, user_id="b", priority=99))
    out = s.schedule()
    assert [it.seq.seq_id for it in out.scheduled] == [0] and not out.swapped_out
    assert gold.status == SequenceStatus.RUNNING


def test_stats_report_per_group_counters():
    qos = qos_of({"Gold": [("a", 50), ("default", 50)], "Bronze": [("b", 100)]})
    s = make_scheduler(max_batch=1, qos=qos)
    s.add_sequence(make_seq(0, 5, max_new=3, user_id="a"))
    s.add_sequence(make_seq(1, 5, max_new=3, user_id="b"))
    fake_run(s, 2)
    groups = s.stats()["qos"]["groups"]
    assert groups["Gold"]["num_running"] == 1 and groups["Bronze"]["num_waiting"] == 1
    assert groups["Gold"]["num_served_tokens"] == 7  # 5 prompt + 2 generated
    assert groups["Bronze"]["num_served_tokens"] == 0
