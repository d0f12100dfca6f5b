"""Server metrics in the Prometheus text format (no client library needed).

Counters and histograms are updated by the server's event loop thread, except the engine step
histograms, which a step observer (`Engine.add_observer`) updates on the engine's loop thread;
the engine's gauges (running / waiting / swapped requests, KV blocks, per-QoS-group counters)
are read from `engine.stats()` at scrape time. Keys missing from the stats are reported as 0.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# engine.stats() key -> (metric name, help); exported as gauges, 0 when the key is missing
ENGINE_GAUGES = {
    "num_running": ("lmengine_num_requests_running", "sequences in the running batch"),
    "num_waiting": ("lmengine_num_requests_waiting", "sequences waiting to be scheduled"),
    "num_swapped": ("lmengine_num_requests_swapped", "sequences swapped out to host memory"),
    "num_free_blocks": ("lmengine_kv_blocks_free", "free device KV blocks"),
    "num_total_blocks": ("lmengine_kv_blocks_capacity", "device KV blocks in the pool"),
    "num_preemptions": ("lmengine_num_preemptions_total", "preemptions since start"),
}


# the phases of a request's time to first token, in order; each ends where the next begins
FIRST_TOKEN_PHASES = {
    "prepare": "from the HTTP request's arrival to its submission to the engine: reading and "
    "validating the body, templating, tokenizing",
    "inbox": "from submission until the engine loop takes the request (the end of the step "
    "running then)",
    "queue_time": "from the engine loop taking the request to its first step",
    "prefill_time": "from its first step to its first token (one step per prefill chunk)",
    "handoff": "from its first token to the server's event loop (the rest of that step's "
    "output stage, the hand-off between threads)",
}


def _name(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in str(text))


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    """Cumulative buckets, a sum and a count."""

    def __init__(self, name: str, help_text: str, buckets=LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, n in zip([*self.buckets, "+Inf"], self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """What the HTTP layer counts: requests by endpoint and outcome, tokens in and out,
    latency histograms, and the requests it holds (in flight, queued)."""

    def __init__(self, slo_ttft_s: float = 0.0, slo_itl_s: float = 0.0) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, finish reason) -> count
        self.http_errors: dict[int, int] = {}  # status -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_in_flight = 0  # choices submitted to the engine and not finished
        self.num_queued = 0  # of those, the ones without a first token yet
        self.ttft = Histogram("lmengine_time_to_first_token_seconds", "time to first token")
        self.tpot = Histogram(
            "lmengine_time_per_output_token_seconds", "mean time per output token after the first"
        )
        self.e2e = Histogram("lmengine_e2e_request_latency_seconds", "end-to-end request latency")
        # where the time to first token went, phase by phase (see `observe_first_token`)
        self.phases = {
            name: Histogram(f"lmengine_request_{name}_seconds", help_text)
            for name, help_text in FIRST_TOKEN_PHASES.items()
        }
        # every engine step (`observe_step`, on the engine's loop thread)
        self.step_seconds = Histogram("lmengine_engine_step_seconds", "engine step duration")
        self.step_tokens = Histogram(
            "lmengine_iteration_tokens_total", "tokens computed per engine step", TOKEN_BUCKETS
        )
        # goodput (`observe_slo`): finished requests, and those meeting each objective
        self.slo_ttft_s, self.slo_itl_s = slo_ttft_s, slo_itl_s
        self.slo_judged = 0
        self.slo_met = {"ttft": 0, "itl": 0, "all": 0}
        # state that traffic grows, each with its bound (docs/operations.md): name -> its size
        self.state_sizes: dict[str, Callable[[], int]] = {}

    def track(self, state: str, size: Callable[[], int]) -> None:
        """Export `size()` as `lmengine_server_state_entries{state=...}` at every scrape."""
        self.state_sizes[state] = size

    def observe_step(self, report) -> None:
        """A step observer (`Engine.add_observer`): the step's duration and tokens."""
        self.step_seconds.observe(report.seconds)
        self.step_tokens.observe(report.num_batched_tokens)

    def observe_first_token(self, received: float, m, now: float) -> None:
        """The phases of one choice's wait for its first token, from the HTTP request's
        arrival (`received`), its RequestMetrics `m` and its arrival on the event loop
        (`now`); all times of time.monotonic()."""
        if m is None or m.first_token_time is None or m.arrival_time is None:
            return
        ends = (m.submit_time, m.arrival_time, m.first_scheduled_time, m.first_token_time, now)
        start = received
        for hist, end in zip(self.phases.values(), ends):
            hist.observe(end - start)
            start = end

    def observe_slo(self, ttft: float, max_gap: float) -> None:
        """A request that finished (stop or length) with this time to first token and this
        longest gap between two of its tokens, judged against the objectives (0: none)."""
        ttft_ok = not self.slo_ttft_s or ttft <= self.slo_ttft_s
        itl_ok = not self.slo_itl_s or max_gap <= self.slo_itl_s
        self.slo_judged += 1
        self.slo_met["ttft"] += ttft_ok
        self.slo_met["itl"] += itl_ok
        self.slo_met["all"] += ttft_ok and itl_ok

    def count_request(self, endpoint: str, finish_reason: str) -> None:
        key = (endpoint, finish_reason)
        self.requests[key] = self.requests.get(key, 0) + 1

    def count_error(self, status: int) -> None:
        self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self, stats: dict) -> str:
        lines: list[str] = []

        def gauge(name: str, help_text: str, value, kind: str = "gauge") -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])

        for key, (name, help_text) in ENGINE_GAUGES.items():
            kind = "counter" if name.endswith("_total") else "gauge"  # Prometheus naming
            gauge(name, help_text, stats.get(key, 0), kind)
        used = stats.get("num_total_blocks", 0) - stats.get("num_free_blocks", 0)
        gauge("lmengine_kv_blocks_used", "device KV blocks in use", used)
        # any other numeric engine stat, and nested ones such as the QoS counters
        nested: dict[str, list[str]] = {}
        for key, value in sorted(stats.items()):
            if key not in ENGINE_GAUGES:
                _walk(f"lmengine_{_name(key)}", str(key), value, (), nested)
        for name, samples in nested.items():
            lines += [f"# HELP {name} engine stat", f"# TYPE {name} gauge", *samples]
        lines += gateway_metrics(stats)
        gauge("lmengine_server_requests_in_flight", "choices being generated", self.num_in_flight)
        gauge("lmengine_server_requests_queued", "choices without a first token", self.num_queued)
        gauge("lmengine_prompt_tokens_total", "prompt tokens", self.prompt_tokens, "counter")
        gauge(
            "lmengine_generation_tokens_total",
            "tokens generated",
            self.generation_tokens,
            "counter",
        )
        lines += [
            "# HELP lmengine_requests_total finished choices by endpoint and finish reason",
            "# TYPE lmengine_requests_total counter",
        ]
        for (endpoint, reason), n in sorted(self.requests.items()):
            lines.append(
                f'lmengine_requests_total{{endpoint="{_label(endpoint)}",'
                f'finish_reason="{_label(reason)}"}} {n}'
            )
        lines += [
            "# HELP lmengine_http_errors_total error answers by status",
            "# TYPE lmengine_http_errors_total counter",
        ]
        for status, n in sorted(self.http_errors.items()):
            lines.append(f'lmengine_http_errors_total{{status="{status}"}} {n}')
        lines += self.render_goodput()
        lines += [
            "# HELP lmengine_server_state_entries entries of the server's bounded tables",
            "# TYPE lmengine_server_state_entries gauge",
        ]
        for state, size in sorted(self.state_sizes.items()):
            lines.append(f'lmengine_server_state_entries{{state="{_label(state)}"}} {size()}')
        steps = (self.step_seconds, self.step_tokens)
        for hist in (self.ttft, self.tpot, self.e2e, *self.phases.values(), *steps):
            lines += hist.render()
        return "\n".join(lines) + "\n"

    def render_goodput(self) -> list[str]:
        """Goodput as counters (a fraction is their ratio: `met{objective="all"} / judged`)
        and the objectives themselves as gauges."""
        lines = [
            "# HELP lmengine_slo_requests_total finished requests judged against the objectives",
            "# TYPE lmengine_slo_requests_total counter",
            f"lmengine_slo_requests_total {self.slo_judged}",
            "# HELP lmengine_slo_met_requests_total finished requests meeting an objective "
            "(ttft, itl, or all of them: goodput)",
            "# TYPE lmengine_slo_met_requests_total counter",
        ]
        lines += [
            f'lmengine_slo_met_requests_total{{objective="{name}"}} {n}'
            for name, n in self.slo_met.items()
        ]
        lines += [
            "# HELP lmengine_slo_objective_seconds the objectives (--slo-ttft-ms, --slo-itl-ms; "
            "0: none)",
            "# TYPE lmengine_slo_objective_seconds gauge",
            f'lmengine_slo_objective_seconds{{objective="ttft"}} {self.slo_ttft_s}',
            f'lmengine_slo_objective_seconds{{objective="itl"}} {self.slo_itl_s}',
        ]
        return lines


def gateway_metrics(stats: dict) -> list[str]:
    """The engine's load under vLLM's metric names, which inference gateways scrape to pick a
    replica (the Gateway API Inference Extension's model server protocol, llm-d): queued and
    running requests, KV cache usage (1 = full; under both of vLLM's names) and the LoRA
    adapters of running and waiting requests (a gauge holding the time of the scrape)."""
    total = stats.get("num_total_blocks", 0)
    usage = (total - stats.get("num_free_blocks", 0)) / total if total else 0.0
    samples = [
        ("vllm:num_requests_waiting", "requests waiting to run", stats.get("num_waiting", 0)),
        ("vllm:num_requests_running", "requests in the running batch", stats.get("num_running", 0)),
        ("vllm:gpu_cache_usage_perc", "KV cache usage, 1 = full", usage),
        ("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full", usage),
    ]  # fmt: skip
    lines = []
    for name, help_text, value in samples:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
    labels = {
        "max_lora": stats.get("max_lora_slots", 0),
        "running_lora_adapters": ",".join(stats.get("running_adapters", ())),
        "waiting_lora_adapters": ",".join(stats.get("waiting_adapters", ())),
    }
    text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
    lines += [
        "# HELP vllm:lora_requests_info LoRA adapters of running and waiting requests",
        "# TYPE vllm:lora_requests_info gauge",
        f"vllm:lora_requests_info{{{text}}} {time.time()}",
    ]
    return lines


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _walk(name: str, key: str, value, labels: tuple, out: dict[str, list[str]]) -> None:
    """Flatten one engine stat into samples. A dict under a plural key whose values are all
    flat dicts is a label dimension (`"groups": {"Gold": {"num_waiting": 1}}` ->
    `..._groups_num_waiting{group="Gold"} 1`); any other dict extends the metric name;
    numbers are samples; anything else is skipped."""
    if _is_number(value):
        text = ",".join(f'{k}="{_label(v)}"' for k, v in labels)
        out.setdefault(name, []).append(f"{name}{{{text}}} {value}" if text else f"{name} {value}")
    elif isinstance(value, dict) and value:
        rows = all(isinstance(v, dict) for v in value.values())
        if (
            rows
            and key.endswith("s")
            and not any(isinstance(x, dict) for v in value.values() for x in v.values())
        ):
            label = _name(key[:-1])
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0])):
                _walk(name, "", v, (*labels, (label, k)), out)
        else:
            for k, v in value.items():
                _walk(f"{name}_{_name(k)}", str(k), v, labels, out)
