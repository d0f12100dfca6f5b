"""The HTTP server, as a real `lmengine serve` process on a free loopback port, driven by the
official `openai` client (and raw HTTP where the client would refuse to send bad input).

One tiny random Llama server serves the whole module: chat and completions, streaming and
not, n, stop, seeds, logprobs, penalties, usage, every 4xx path, 64 concurrent streams,
client disconnects (blocks freed, seen through /metrics), QoS endpoints and a schemathesis
run over the OpenAPI document that must find no 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

try:  # the HTTP client the installed openai package uses
    import httpx2 as httpx
except ImportError:
    import httpx

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROOT = Path(__file__).resolve().parent.parent
QOS_CONFIG = {  # LMDeploy's QoS config format
    "enable_user_qos": 1,
    "user_groups": ["Platinum", "Gold"],
    "user_group_map": {
        "Platinum": [{"id": "alice", "quota_pct": 100}],
        "Gold": [{"id": "bob", "quota_pct": 100}, {"id": "default", "quota_pct": 100}],
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *flags: str, timeout: float = 400.0) -> tuple[subprocess.Popen, str]:
    """`python -m lmengine serve MODEL --port P ...`; returns once /health answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lmengine", "serve", model, "--port", str(port), *flags]
    # NOTE: output to a file, not a pipe: nobody reads a pipe while the tests run, and a
    # server that logs a lot (tracebacks) would block once the pipe's buffer filled up
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server_output(proc)}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout} s:\n{server_output(proc)}")


@contextlib.contextmanager
def tiny_server(path: str, *flags: str) -> Iterator[str]:
    """A served tiny model for a test module: one thread (fastest for a tiny model on a busy
    machine), 4-token blocks, then `flags`; yields its URL and checks that it stops cleanly."""
    proc, url = start_server(path, "--num-threads", "1", "--block-size", "4", *flags)
    try:
        yield url
    finally:
        code = stop_server(proc)
    assert code == 0


# a served tiny model known as "tiny", behind the API key (tiny_server's flags)
TINY_OPENAI_FLAGS = (
    "--api-keys",
    API_KEY,
    "--served-model-name",
    "tiny",
    "--num-gpu-blocks",
    "512",
)


def openai_client(url: str) -> openai.OpenAI:
    """The official client of a test server, without retries."""
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def server_output(proc: subprocess.Popen) -> str:
    """Everything the server process printed so far."""
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read()


def stop_server(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; checks every line's syntax on the way."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+", line), line
            continue
        m = re.fullmatch(
            r'([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})?) (\S+)', line
        )
        assert m, f"bad metrics line: {line!r}"
        out[m.group(1)] = float(m.group(2))
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Metrics once nothing runs, waits or holds a KV block."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = (
            m["lmengine_num_requests_running"]
            + m["lmengine_num_requests_waiting"]
            + m["lmengine_kv_blocks_used"]
            + m["lmengine_server_requests_in_flight"]
        )
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_llama_path, tmp_path_factory):
    qos = tmp_path_factory.mktemp("qos") / "qos.json"
    qos.write_text(json.dumps(QOS_CONFIG))
    with tiny_server(
        tiny_llama_path,
        "--api-keys", API_KEY, "other-key",
        "--session-len", "640",  # long enough that a disconnected request is still running
        "--max-batch-size", "64",
        "--num-gpu-blocks", "512",
        "--qos-config-path", str(qos),
        "--enable-lora-updates",  # so that the schema fuzzing reaches the adapter endpoints
        "--slo-ttft-ms", "60000", "--slo-itl-ms", "0.001",  # goodput: one always met, one never
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


# ---- the happy paths ----------------------------------------------------------------------------
def test_models_health_and_no_key_for_health(server, client, tiny_llama_path):
    ids = [m.id for m in client.models.list().data]
    assert ids == [os.path.basename(tiny_llama_path)]
    for path in ("/health", "/ping", "/engine_check"):
        assert httpx.get(server + path).status_code == 200, path


def test_chat_stream_equals_nonstream_and_usage(client, model):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


PHASES = ["prepare", "inbox", "queue_time", "prefill_time", "handoff"]


def test_time_to_first_token_is_split_into_its_phases(server, client, model):
    """/metrics splits each choice's time to first token into consecutive phases (HTTP and
    tokenizing, the engine's inbox, its queue, the prefill, the hand-off back): per choice
    one sample each, and together they are the time to first token; and every finished
    choice is judged against the goodput objectives."""
    wait_idle(server)
    before = metrics(server)
    client.completions.create(model=model, prompt=["Once upon", "a time"], n=2, **GREEDY)
    after = metrics(server)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("lmengine_time_to_first_token_seconds_count") == 4
    for phase in PHASES:
        assert delta(f"lmengine_request_{phase}_seconds_count") == 4, phase
    parts = sum(delta(f"lmengine_request_{phase}_seconds_sum") for phase in PHASES)
    assert parts == pytest.approx(delta("lmengine_time_to_first_token_seconds_sum"), abs=1e-6)
    assert delta("lmengine_request_prefill_time_seconds_sum") > 0
    # the engine's steps, from its step observer: every token of the answers went through one
    assert delta("lmengine_engine_step_seconds_count") >= GREEDY["max_tokens"]
    assert delta("lmengine_iteration_tokens_total_sum") >= 4 * (GREEDY["max_tokens"] - 1)
    # goodput: every choice is judged; the first token came within 60 s, but no gap between
    # tokens is 1 us
    met = 'lmengine_slo_met_requests_total{{objective="{}"}}'
    assert delta("lmengine_slo_requests_total") == 4
    assert delta(met.format("ttft")) == 4 and delta(met.format("itl")) == 0
    assert delta(met.format("all")) == 0
    assert after['lmengine_slo_objective_seconds{objective="ttft"}'] == 60.0


def test_completion_stream_equals_nonstream(client, model):
    whole = client.completions.create(model=model, prompt="Once upon a time", **GREEDY)
    chunks = list(
        client.completions.create(model=model, prompt="Once upon a time", stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens == 24
    # token ids as the prompt, and two prompts at once: prompt-major choice order
    batch = client.completions.create(model=model, prompt=["Once upon a time", "Hello"], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == whole.choices[0].text
    assert batch.usage.completion_tokens == 48


def test_n_seed_and_stop(client, model):
    msgs = [{"role": "user", "content": "hi"}]
    kw = dict(model=model, messages=msgs, max_tokens=12, temperature=1.0, seed=7)
    a = client.chat.completions.create(n=2, **kw)
    b = client.chat.completions.create(n=2, **kw)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    assert 2 <= a.usage.completion_tokens <= 24
    # stop: cut the greedy text at a word from its middle
    whole = client.completions.create(model=model, prompt="Once upon a time", **GREEDY)
    text = whole.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model=model, prompt="Once upon a time", stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]


def test_logprobs_chat_and_completion(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 24
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy: the chosen one is the best
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = client.completions.create(model=model, prompt="Once upon a time", logprobs=2, **GREEDY)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 24
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_extensions_reach_the_engine(client, model):
    # top_k=1 sampling is greedy; min_tokens forces the length past any EOS
    r = client.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0.8, seed=1,
        extra_body={"top_k": 1, "min_tokens": 8, "repetition_penalty": 1.3, "priority": 2,
                    "frequency_penalty": 0.5, "presence_penalty": 0.5},
    )  # fmt: skip
    again = client.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0.0,
        extra_body={"min_tokens": 8, "repetition_penalty": 1.3,
                    "frequency_penalty": 0.5, "presence_penalty": 0.5},
    )  # fmt: skip
    assert r.choices[0].text == again.choices[0].text
    assert r.usage.completion_tokens == 8


# ---- errors -------------------------------------------------------------------------------------
def error_of(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0"),  # no role
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": 5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"prompt": ""}, None),  # empty prompt: refused by the engine
        ("/v1/completions", {"prompt": [5] * 700}, None),  # over session_len: the engine
        ("/v1/completions", {"prompt": [10**9]}, None),  # outside the vocabulary: the engine
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/chat/interactive_qos", {"prompt": "x", "session_id": "s"}, "session_id"),
    ],
)
def test_bad_requests_answer_400(server, path, body, param):
    r = httpx.post(server + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_malformed_json_auth_and_not_found(server, client):
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(server + "/v1/chat/completions", content=b'{"messages": [', headers=auth)
    assert r.status_code == 400 and "json" in error_of(r)["message"].lower()
    r = httpx.post(server + "/v1/completions", content=b"[1, 2]", headers=auth)
    assert r.status_code == 400
    assert httpx.get(server + "/v1/nothing", headers=auth).status_code == 404
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(server + "/v1/models")
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = httpx.get(server + "/v1/models", headers={"Authorization": "Bearer other-key"})
    assert r.status_code == 200
    assert httpx.get(server + "/metrics").status_code == 401


# ---- load and disconnects -----------------------------------------------------------------------
def test_64_concurrent_streams_complete(server, model):
    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"story number {i}"}],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        return text, usage, reason

    async def main():
        aclient = openai.AsyncOpenAI(
            base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(reason == "length" and usage.completion_tokens == 24 for _, usage, reason in results)
    assert all(text for text, _, _ in results)
    m = wait_idle(server)
    assert m["lmengine_kv_blocks_used"] == 0 and m["lmengine_num_requests_running"] == 0


def test_client_disconnect_cancels_and_frees_blocks(server):
    before = metrics(server)
    cancelled = 'lmengine_requests_total{endpoint="completions",finish_reason="cancel"}'
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "x", "max_tokens": 600, "temperature": 0, "ignore_eos": True, "n": 3}
    # streaming: read two events, then hang up
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True},
                      headers=headers, timeout=30) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # not streaming: give up after 0.3 s (the request needs far longer)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=0.3)
    m = wait_idle(server)
    assert m["lmengine_kv_blocks_used"] == 0
    assert m["lmengine_num_requests_running"] == 0 and m["lmengine_num_requests_waiting"] == 0
    assert m["lmengine_server_requests_in_flight"] == 0
    assert m.get(cancelled, 0) - before.get(cancelled, 0) == 6


def test_a_20mb_body_delays_neither_health_nor_a_running_stream(server):
    """While a 20 MB chat request is refused (413, the default 4 MB limit), /health answers
    and a running stream's tokens arrive within tens of milliseconds of their idle values."""
    import statistics
    import threading

    health, gaps, stop = [], [], threading.Event()

    def poll_health():
        with httpx.Client() as http:
            while not stop.is_set():
                start = time.perf_counter()
                assert http.get(server + "/health").status_code == 200
                health.append((start, time.perf_counter() - start))
                time.sleep(0.002)

    def stream_tokens():
        body = {"prompt": "hi", "max_tokens": 600, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                with http.stream("POST", server + "/v1/completions", json=body, headers=AUTH) as r:
                    last = None
                    for _ in r.iter_lines():
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append((now, now - last))
                        last = now

    workers = [threading.Thread(target=poll_health), threading.Thread(target=stream_tokens)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(1.5)
        big = json.dumps({"messages": [{"role": "user", "content": "word " * 4_000_000}]})
        start = time.perf_counter()
        r = httpx.post(server + "/v1/chat/completions", content=big, headers=AUTH, timeout=60)
        end = time.perf_counter() + 0.05
        time.sleep(0.5)
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def idle_and_busy(samples):
        idle = [v for t, v in samples if t < start - 0.2]
        busy = [v for t, v in samples if start <= t <= end]
        return statistics.quantiles(idle, n=100)[98], max(busy, default=0.0)

    # NOTE: 50 ms over the idle p99: the engine thread releases the GIL in every native call,
    # and while the event loop is busy in Python (refusing the body) each call can wait up to
    # the 5 ms switch interval to take it back: one gap of 40 ms was seen in a full suite run.
    # Handling the body on the event loop would take longer than this.
    for what, samples in (("health", health), ("token gap", gaps)):
        idle_p99, busy_max = idle_and_busy(samples)
        assert busy_max < idle_p99 + 0.05, (what, idle_p99, busy_max)
    assert wait_idle(server)["lmengine_kv_blocks_used"] == 0


# ---- QoS ----------------------------------------------------------------------------------------
def test_qos_endpoints(server, model):
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server + "/v1/chat/completions_qos", headers=h, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "user_id": "alice",
        "max_tokens": 5, "temperature": 0,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 5
    r = httpx.post(server + "/v1/completions_qos", headers=h, json={
        "prompt": "hi", "user_id": "bob", "max_tokens": 5, "temperature": 0,
    })  # fmt: skip
    assert r.status_code == 200 and r.json()["object"] == "text_completion"

    def turn(text, **kw):
        body = {"prompt": text, "session_id": 42, "interactive_mode": True, "temperature": 0,
                "request_output_len": 6, "ignore_eos": True, "user_id": "alice", **kw}  # fmt: skip
        r = httpx.post(server + "/v1/chat/interactive_qos", headers=h, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    first = turn("hi")
    assert first["history_tokens"] == 0 and first["tokens"] == 6
    second = turn("and then?")
    assert second["history_tokens"] == first["input_tokens"] + first["tokens"]
    assert second["input_tokens"] > second["history_tokens"]
    # streamed turn: newline-delimited JSON, the deltas add up; interactive_mode=False ends it
    with httpx.stream("POST", server + "/v1/chat/interactive_qos", headers=h, json={
        "prompt": "more", "session_id": 42, "stream": True, "temperature": 0,
        "request_output_len": 6, "ignore_eos": True,
    }) as r:  # fmt: skip
        events = [json.loads(line) for line in r.iter_lines() if line]
    assert events[-1]["finish_reason"] == "length" and events[-1]["tokens"] == 6
    assert events[-1]["history_tokens"] == second["input_tokens"] + second["tokens"]
    assert turn("new start")["history_tokens"] == 0  # the session was ended
    assert "/v1/chat/interactive_qos" in httpx.get(server + "/openapi.json").json()["paths"]


# ---- schema fuzzing -----------------------------------------------------------------------------
def test_openapi_schema_fuzz_finds_no_5xx_and_no_nonconformance(server):
    """schemathesis as a user runs it: every phase, every check, positive and negative
    cases, over the OpenAPI document of a server with QoS on. No 5xx, no response that the
    document does not describe (status, content type, headers, body), no schema-violating
    request accepted, no valid one refused except for what no schema can state (see
    tests/schemathesis_hooks.py, which also bounds the work a valid request asks for)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks"}
    assert len(httpx.get(server + "/openapi.json").json()["paths"]) >= 15
    # NOTE: no --max-time: with it, schemathesis repeats fuzzing until the time is spent
    cmd = [
        str(Path(sys.executable).with_name("st")), "run", server + "/openapi.json",
        "-H", f"Authorization: Bearer {API_KEY}",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--phases", "examples,coverage,fuzzing,stateful", "--mode", "all",
        "--continue-on-failure", "--no-shrink", "--max-examples", "40", "--seed", "1",
        "--request-timeout", "60",
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    # NOTE: no issue; warnings only that the adapter endpoints refuse most bodies (no folder
    # of the fuzzer's names exists, none of its names is loaded) and that no stored response
    # has the fuzzer's ids
    assert re.search(r"(No issues found|\d+ warnings?) in ", run.stdout), run.stdout[-3000:]
    warned = set(re.findall(r"^  - (\w+ \S+)$", run.stdout, re.MULTILINE))
    expected = {"POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter",
                "GET /v1/responses/{response_id}"}  # fmt: skip
    assert warned <= expected, warned
    found = re.search(r"(\d+) generated, \1 passed", run.stdout)
    assert found and int(found.group(1)) > 2000, run.stdout[-2000:]
    m = wait_idle(server, timeout=60)
    assert m["lmengine_kv_blocks_used"] == 0
    assert httpx.get(server + "/health").status_code == 200


def test_beam_search_through_the_server(server, client, model, tiny_llama_path):
    from lmengine import GenerationConfig
    from tests.hf_reference import hf_beam

    ids = [17, 410, 93, 1200, 7]
    beam = {"num_beams": 3, "length_penalty": 0.5, "early_stopping": "never"}
    r = client.completions.create(model=model, prompt=ids, max_tokens=6, extra_body=beam)
    ref, _ = hf_beam(tiny_llama_path, ids, GenerationConfig(max_new_tokens=6, **beam))
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tiny_llama_path)
    assert r.choices[0].text == tok.decode(ref[0], skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ref[0])
    for bad, param in (({"n": 2}, "n"), ({"stop": "x"}, None), ({"logprobs": 2}, None)):
        resp = httpx.post(
            server + "/v1/completions",
            json={"prompt": ids, "max_tokens": 4, **beam, **bad},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert resp.status_code == 400, resp.text
        assert error_of(resp)["param"] == param
