"""The Prometheus text of /metrics from engine stats, without a server: missing keys read 0,
nested stats (the QoS counters per group and per user) become labelled samples, goodput
counts the requests meeting each objective."""

from __future__ import annotations

import re

from lmengine.serve.metrics import ServerMetrics

SAMPLE = re.compile(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? \S+')


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            assert SAMPLE.fullmatch(line), line
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_engine_stats_missing_keys_read_zero():
    m = samples(ServerMetrics().render({"num_running": 3}))
    assert m["lmengine_num_requests_running"] == 3
    assert m["lmengine_num_requests_swapped"] == 0 and m["lmengine_kv_blocks_used"] == 0


def test_nested_qos_stats_become_labelled_samples():
    metrics = ServerMetrics()
    metrics.ttft.observe(0.02)
    metrics.count_request("chat_completions", "stop")
    stats = {
        "num_running": 2,
        "num_waiting": 1,
        "num_swapped": 4,
        "num_free_blocks": 10,
        "num_total_blocks": 16,
        "num_swap_outs": 5,
        "qos": {
            "groups": {"Gold": {"num_waiting": 1, "num_served_tokens": 7}, "Bronze": {}},
            "users": {"alice": {"group": "Gold", "quota": 0.5, "num_served_tokens": 7}},
        },
    }
    m = samples(metrics.render(stats))
    assert m["lmengine_kv_blocks_used"] == 6 and m["lmengine_num_requests_swapped"] == 4
    assert m["lmengine_num_swap_outs"] == 5
    assert m['lmengine_qos_groups_num_waiting{group="Gold"}'] == 1
    assert m['lmengine_qos_groups_num_served_tokens{group="Gold"}'] == 7
    assert m['lmengine_qos_users_quota{user="alice"}'] == 0.5
    assert m['lmengine_requests_total{endpoint="chat_completions",finish_reason="stop"}'] == 1
    assert m['lmengine_time_to_first_token_seconds_bucket{le="0.025"}'] == 1
    assert m["lmengine_time_to_first_token_seconds_count"] == 1


def test_goodput_counts_the_requests_meeting_each_objective():
    metrics = ServerMetrics(slo_ttft_s=0.5, slo_itl_s=0.1)
    for ttft, gap in ((0.2, 0.05), (0.7, 0.05), (0.2, 0.3), (0.9, 0.4)):
        metrics.observe_slo(ttft, gap)
    m = samples(metrics.render({}))
    assert m["lmengine_slo_requests_total"] == 4
    assert m['lmengine_slo_met_requests_total{objective="ttft"}'] == 2
    assert m['lmengine_slo_met_requests_total{objective="itl"}'] == 2
    assert m['lmengine_slo_met_requests_total{objective="all"}'] == 1
    everything = ServerMetrics()  # no objectives: every request meets them
    everything.observe_slo(30.0, 5.0)
    assert samples(everything.render({}))['lmengine_slo_met_requests_total{objective="all"}'] == 1
