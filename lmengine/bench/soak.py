"""A mixed client load for soaking `lmengine serve` (benchmarks/soak.py, tests/test_soak.py).

Worker threads pick operations at random by weight until a deadline: streaming and whole
chat and completions, streams the client drops after a few tokens, requests it gives up on
(cancellations), structured outputs, tool calls, scoring (echo + logprobs), QoS tenants
(named, unknown, interactive sessions), stored responses, bad inputs (each must be a 4xx), and
now and then a burst above `--max-queued-requests` (429s expected) or an adapter loaded, used
and unloaded. Every answer is tallied by operation and status; one the operation did not
expect (any 5xx, a 4xx to a good request) is kept with its body. Streams give TTFT and
inter-token latency samples. Imports no torch: the watcher and the test run it beside a server.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lmengine.bench.report import nearest_rank

try:  # the HTTP client the installed openai package uses
    import httpx2 as httpx
except ImportError:
    import httpx  # type: ignore[no-redef]

QOS_CONFIG = {  # LMDeploy's format: two named tenants and everyone else
    "enable_user_qos": 1,
    "user_groups": ["Gold", "Bronze"],
    "user_group_map": {
        "Gold": [{"id": "gold", "quota_pct": 100}],
        "Bronze": [{"id": "bronze", "quota_pct": 50}, {"id": "default", "quota_pct": 50}],
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": SCHEMA,
        },
    }
]
WORDS = "the a river city cloud stone light quiet seven bright under over story".split()
# deliberate refusals: 429 (queue full) for any generation, and in a burst also 503 from the
# connection bound (`too_many_connections`); every other 5xx is a failure
QUEUE_FULL = 429
# after a 429 a client waits as the server's Retry-After asks (the openai client does so too),
# rather than asking again at once for as long as a burst fills the queue
RETRY_AFTER_S = 1.0


@dataclass
class Outcome:
    """One operation's answer: its HTTP status (0: the client gave up or lost the
    connection), whether the operation expected it, and what the stream measured."""

    op: str
    status: int
    is_expected: bool
    body: str = ""
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)


class Tally:
    """Every outcome, by operation and status, with time stamps for per-minute latency
    percentiles and interval counts; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.start = time.monotonic()
        self.counts: dict[str, dict[int, int]] = {}
        self.unexpected: list[dict] = []
        self.num_unexpected = 0
        self.num_unexpected_5xx = 0
        self.num_lost = 0  # connections lost or refused without an answer
        self.samples: list[tuple[float, float, list[float]]] = []  # (t, ttft, itls)
        self.num_done = 0

    def add(self, out: Outcome) -> None:
        now = time.monotonic() - self.start
        with self.lock:
            by_status = self.counts.setdefault(out.op, {})
            by_status[out.status] = by_status.get(out.status, 0) + 1
            self.num_done += 1
            if out.ttft is not None:
                self.samples.append((now, out.ttft, out.itls))
            if not out.is_expected:
                self.num_unexpected += 1
                self.num_unexpected_5xx += out.status >= 500
                self.num_lost += out.status == 0
                if len(self.unexpected) < 50:
                    row = {"t": round(now, 1), "op": out.op, "status": out.status}
                    self.unexpected.append({**row, "body": out.body[:300]})

    def statuses(self) -> dict[int, int]:
        """Answers by status, over every operation."""
        total: dict[int, int] = {}
        with self.lock:
            for by_status in self.counts.values():
                for status, n in by_status.items():
                    total[status] = total.get(status, 0) + n
        return total

    def latency_by_minute(self, minute_s: float = 60.0) -> list[dict]:
        """TTFT and ITL percentiles (ms) of the streams that started in each minute."""
        with self.lock:
            samples = list(self.samples)
        rows: dict[int, tuple[list[float], list[float]]] = {}
        for t, ttft, itls in samples:
            ttfts, gaps = rows.setdefault(int(t // minute_s), ([], []))
            ttfts.append(ttft * 1e3)
            gaps.extend(x * 1e3 for x in itls)
        return [
            dict(
                minute=m,
                num_streams=len(ttfts),
                ttft_ms=percentiles(ttfts),
                itl_ms=percentiles(gaps),
            )  # fmt: skip
            for m, (ttfts, gaps) in sorted(rows.items())
        ]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": round(nearest_rank(values, q), 2) for q in (50, 90, 99)}


def expected(status: int) -> bool:
    """Whether a generation may answer `status`: 200, or 429 while the queue is full."""
    return status in (200, QUEUE_FULL)


class Load:
    """The client mix against one server. `model` is its served name; `adapter_path` a peft
    folder the server may load (None: no adapter operations); `qos` whether it has the
    QOS_CONFIG; `queue_limit` its `--max-queued-requests` (0: no bursts)."""

    def __init__(
        self,
        url: str,
        model: str,
        headers: dict | None = None,
        adapter_path: str | None = None,
        qos: bool = True,
        queue_limit: int = 0,
        max_tokens: int = 24,
        seed: int = 0,
    ) -> None:
        self.url, self.model, self.headers = url, model, dict(headers or {})
        self.adapter_path, self.qos, self.queue_limit = adapter_path, qos, queue_limit
        self.max_tokens = max_tokens
        self.tally = Tally()
        self.rng = random.Random(seed)
        self.rng_lock = threading.Lock()
        self.exclusive = threading.Lock()  # one burst or adapter cycle at a time
        self.num_adapters = 0
        self.ops: dict[str, tuple[float, Callable[[httpx.Client], Outcome]]] = {
            "chat": (3, lambda c: self.generate(c, "chat", stream=False)),
            "chat_stream": (4, lambda c: self.generate(c, "chat", stream=True)),
            "completion": (2, lambda c: self.generate(c, "completion", stream=False)),
            "completion_stream": (2, lambda c: self.generate(c, "completion", stream=True)),
            "disconnect": (2, self.disconnect),
            "give_up": (1, self.give_up),
            "structured": (1.5, self.structured),
            "tools": (1.5, self.tools),
            "score": (1.5, self.score),
            "responses": (1, self.responses),
            "bad_input": (2, self.bad_input),
        }
        if qos:
            self.ops["qos_tenant"] = (2, self.qos_tenant)
            self.ops["interactive"] = (1, self.interactive)
        if queue_limit:
            self.ops["burst"] = (0.15, self.burst)
        if adapter_path:
            self.ops["adapter"] = (0.3, self.adapter_cycle)

    # ---- driving ------------------------------------------------------------------------------
    def run(self, seconds: float, num_workers: int) -> Tally:
        """`num_workers` threads doing random operations for `seconds`; returns the tally."""
        deadline = time.monotonic() + seconds
        names = list(self.ops)
        weights = [self.ops[n][0] for n in names]

        # NOTE: the rare operations run once at the start whatever the dice say, so that a
        # short run has them too
        first: list[str] = [n for n in ("burst", "adapter") if n in self.ops]

        def worker(i: int) -> None:
            with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as c:
                todo = list(first) if i == 0 else []
                while time.monotonic() < deadline:
                    if todo:
                        name = todo.pop(0)
                    else:
                        with self.rng_lock:
                            name = self.rng.choices(names, weights)[0]
                    try:
                        out = self.ops[name][1](c)
                    except httpx.HTTPError as e:  # a lost connection is never expected
                        out = Outcome(name, 0, False, f"{type(e).__name__}: {e}")
                    self.tally.add(out)
                    if out.status == QUEUE_FULL:
                        time.sleep(RETRY_AFTER_S)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True)
                   for i in range(num_workers)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.tally

    def pick(self, seq):
        with self.rng_lock:
            return self.rng.choice(seq)

    def text(self, num_words: int = 12) -> str:
        with self.rng_lock:
            return " ".join(self.rng.choice(WORDS) for _ in range(num_words))

    def body(self, kind: str, **extra) -> tuple[str, dict]:
        """The path and body of a chat or completion request with a random prompt."""
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.7, **extra}
        if kind == "chat":
            body.setdefault("messages", [{"role": "user", "content": self.text()}])
            return "/v1/chat/completions", body
        body.setdefault("prompt", self.text())
        return "/v1/completions", body

    # ---- operations ---------------------------------------------------------------------------
    def generate(self, c: httpx.Client, kind: str, stream: bool, op: str = "", **extra) -> Outcome:
        path, body = self.body(kind, **extra)
        op = op or kind + ("_stream" if stream else "")
        if not stream:
            r = c.post(path, json=body)
            return Outcome(op, r.status_code, expected(r.status_code), r.text)
        return self.stream(c, op, path, {**body, "stream": True})

    def stream(self, c: httpx.Client, op: str, path: str, body: dict, stop_after: int = 0):
        """A streamed request read event by event: TTFT (to the first event) and the gaps
        between events; with `stop_after`, the client drops the connection after that many."""
        start = time.monotonic()
        last, ttft, itls, events = start, None, [], 0
        with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return Outcome(op, r.status_code, expected(r.status_code), r.text)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if "error" in json.loads(line.removeprefix("data: ")):
                    return Outcome(op, 200, False, line)
                now = time.monotonic()
                if ttft is None:
                    ttft = now - start
                else:
                    itls.append(now - last)
                last, events = now, events + 1
                if stop_after and events >= stop_after:
                    break  # NOTE: leaving the block closes the connection mid-stream
        return Outcome(op, 200, True, ttft=ttft, itls=itls)

    def disconnect(self, c: httpx.Client) -> Outcome:
        path, body = self.body(self.pick(["chat", "completion"]), stream=True)
        body.update(max_tokens=200, ignore_eos=True)
        return self.stream(c, "disconnect", path, body, stop_after=3)

    def give_up(self, c: httpx.Client) -> Outcome:
        """A whole request the client stops waiting for: the server cancels it."""
        path, body = self.body("completion", max_tokens=300, ignore_eos=True)
        try:
            r = c.post(path, json=body, timeout=httpx.Timeout(120, read=0.3))
        except httpx.TimeoutException:
            return Outcome("give_up", 0, True)
        return Outcome("give_up", r.status_code, expected(r.status_code), r.text)

    def structured(self, c: httpx.Client) -> Outcome:
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
        path, body = self.body("chat", response_format=fmt, max_tokens=60, temperature=0)
        r = c.post(path, json=body)
        ok = expected(r.status_code)
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop":
            try:  # a finished answer must match the schema's shape
                ok = set(json.loads(r.json()["choices"][0]["message"]["content"])) == {
                    "city", "days"}  # fmt: skip
            except ValueError:
                ok = False
        return Outcome("structured", r.status_code, ok, r.text)

    def tools(self, c: httpx.Client) -> Outcome:
        stream = self.pick([False, True])
        extra = dict(tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
        if stream:
            return self.stream(c, "tools_stream", *self.body("chat", stream=True, **extra))
        path, body = self.body("chat", **extra)
        r = c.post(path, json=body)
        ok = expected(r.status_code)
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            ok = choice["finish_reason"] in ("tool_calls", "length")
        return Outcome("tools", r.status_code, ok, r.text)

    def score(self, c: httpx.Client) -> Outcome:
        extra = self.pick([{"echo": True, "logprobs": 1, "max_tokens": 0},
                           {"prompt_logprobs": 2, "max_tokens": 1}])  # fmt: skip
        path, body = self.body("completion", **extra)
        r = c.post(path, json=body)
        return Outcome("score", r.status_code, expected(r.status_code), r.text)

    def responses(self, c: httpx.Client) -> Outcome:
        body = {"model": self.model, "input": self.text(), "max_output_tokens": 16, "store": True}
        r = c.post("/v1/responses", json=body)
        return Outcome("responses", r.status_code, expected(r.status_code), r.text)

    def qos_tenant(self, c: httpx.Client) -> Outcome:
        user = self.pick(["gold", "bronze", "default", f"stranger-{self.pick(range(10**6))}"])
        path, body = self.body(self.pick(["chat", "completion"]), user_id=user)
        r = c.post(path.replace("completions", "completions_qos"), json=body)
        return Outcome("qos_tenant", r.status_code, expected(r.status_code), r.text)

    def interactive(self, c: httpx.Client) -> Outcome:
        """A turn of one of many sessions (new ids keep coming), or a cancel."""
        sid = self.pick(range(10**6))
        body = {"session_id": sid, "prompt": self.text(6), "interactive_mode": True,
                "request_output_len": 8, "user_id": "gold"}  # fmt: skip
        if self.pick([False, False, True]):
            body["cancel"] = True
        r = c.post("/v1/chat/interactive_qos", json=body)
        return Outcome("interactive", r.status_code, expected(r.status_code), r.text)

    def bad_input(self, c: httpx.Client) -> Outcome:
        """One of several bad requests: each must be answered 4xx (never 5xx, never 200)."""
        path, body = self.body("chat")
        bad = self.pick([
            {"max_tokens": -3}, {"temperature": 9.0}, {"messages": []},
            {"model": "no-such-model"}, {"max_tokens": 10**7}, {"n": 10**6},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                 "schema": {"type": "nope"}}}},
        ])  # fmt: skip
        if self.pick([False, True]):
            r = c.post(path, json={**body, **bad})
        else:
            cut = b'{"messages": ['  # JSON cut short
            r = c.post(path, content=cut, headers={"Content-Type": "application/json"})
        return Outcome("bad_input", r.status_code, 400 <= r.status_code < 500, r.text)

    def burst(self, c: httpx.Client) -> Outcome:
        """3x the queue limit of requests at once: some must be refused with 429."""
        if not self.exclusive.acquire(blocking=False):  # another burst or adapter cycle runs
            return self.generate(c, "chat", stream=False)
        try:
            statuses: list[int] = []
            start = threading.Barrier(3 * self.queue_limit)

            def one() -> None:
                with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as own:
                    path, body = self.body("completion", prompt=self.text(60), max_tokens=8)
                    start.wait()
                    r = own.post(path, json=body)
                    ok = r.status_code in (200, QUEUE_FULL) or (
                        r.status_code == 503 and "too_many_connections" in r.text
                    )
                    statuses.append(r.status_code)
                    if not ok:
                        self.tally.add(Outcome("burst_request", r.status_code, False, r.text))

            threads = [threading.Thread(target=one) for _ in range(3 * self.queue_limit)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            refused = sum(s in (QUEUE_FULL, 503) for s in statuses)
            return Outcome("burst", QUEUE_FULL if refused else 200, True)
        finally:
            self.exclusive.release()

    def adapter_cycle(self, c: httpx.Client) -> Outcome:
        """Load an adapter under a new name, generate with it, unload it."""
        if not self.exclusive.acquire(blocking=False):  # a burst runs
            return self.generate(c, "chat", stream=False)
        try:
            self.num_adapters += 1
            name = f"soak-{self.num_adapters}"
            load = {"lora_name": name, "lora_path": self.adapter_path}
            r = c.post("/v1/load_lora_adapter", json=load)
            if r.status_code != 200:
                return Outcome("adapter", r.status_code, False, r.text)
            path, body = self.body("chat", model=name)
            used = c.post(path, json=body)
            r = c.post("/v1/unload_lora_adapter", json={"lora_name": name})
            if used.status_code != 200:
                return Outcome("adapter", used.status_code, expected(used.status_code), used.text)
            return Outcome("adapter", r.status_code, r.status_code == 200, r.text)
        finally:
            self.exclusive.release()
