"""The HTTP boundary, strict: each kind of input a client can get wrong is answered with the
right status and an OpenAI-shaped body in the user's terms (lone surrogates, bodies over the
limit, roles and missing content, requests that can never fit the context or the queue),
validation before the queue check, tokenizing off the event loop, a truthful OpenAPI
document, and a graceful shutdown that ends every request it must cut with a readable error.

In-process (FastAPI's TestClient over the tiny model) where the server's state is set by
hand; a real process for the shutdown."""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import pytest
import requests
from fastapi.testclient import TestClient

from lmengine import Engine, EngineConfig
from lmengine.serve.app import ServerSettings, build_app
from lmengine.serve.client import ServerContext
from tests.test_server import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def app(tiny_llama_path):
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=256))
    settings = ServerSettings(
        model_name="tiny", api_keys=[API_KEY], max_queued_requests=4, max_body_bytes=1 << 20
    )
    with TestClient(build_app(engine, settings), raise_server_exceptions=False) as http:
        yield http


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def post(app, path: str, body: dict):
    """POST JSON as a client's serializer writes it (lone surrogates as \\ud800 escapes)."""
    headers = {**AUTH, "Content-Type": "application/json"}
    return app.post(path, headers=headers, content=json.dumps(body))


def chat(app, **fields):
    return post(app, "/v1/chat/completions", {"max_tokens": 4, **fields})


def complete(app, **fields):
    return post(app, "/v1/completions", {"max_tokens": 4, **fields})


@pytest.mark.parametrize("prompt", ["a\ud800b", ["fine", "a\udfffb"]])
def test_lone_surrogates_are_400_in_the_users_terms(app, prompt):
    body = error_of(complete(app, prompt=prompt), 400)
    assert "lone surrogate is not valid Unicode text" in body["message"]
    assert "U+D800" in body["message"] or "prompt.1 (U+DFFF)" in body["message"]
    message = [{"role": "user", "content": "x\ud800"}]
    body = error_of(chat(app, messages=message), 400)
    assert "messages.0.content (U+D800)" in body["message"]
    assert "tokeniz" not in body["message"]
    error_of(post(app, "/tokenize", {"prompt": "\ud800"}), 400)


def test_bodies_over_the_limit_are_413_before_parsing(app):
    big = "x" * (1 << 20)
    body = error_of(chat(app, messages=[{"role": "user", "content": big}]), 413)
    assert body["code"] == "request_too_large" and str(1 << 20) in body["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(9):
            yield b"x" * (1 << 17)
        yield b'"}]}'

    r = app.post(
        "/v1/chat/completions",
        headers={**AUTH, "Content-Type": "application/json"},
        content=chunks(),
    )
    error_of(r, 413)
    assert chat(app, messages=HELLO).status_code == 200


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "wizard", "content": "hi"}], "messages.0: a message is an object whose role"),
        (["hi"], "messages.0: a message is an object whose role is one of system, developer"),
        ([{"role": "user"}], "messages.0.content: Field required"),
        ([{"role": "tool", "content": "1"}], "messages.0.tool_call_id: Field required"),
        ([{"role": "user", "content": 5}], "messages.0.content"),
        ([{"role": "user", "content": "a"}], None),  # with n as a string, below
    ],
)
def test_roles_content_and_types_are_checked(app, messages, message):
    if message is None:  # the schema's types are the server's: no "2" for 2
        assert (
            "n: Input should be a valid integer"
            in error_of(chat(app, messages=messages, n="2"), 400)["message"]
        )
        return
    assert message in error_of(chat(app, messages=messages), 400)["message"]


def test_developer_role_and_assistant_calls_without_content_are_accepted(app):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "42"},
    ]
    assert chat(app, messages=messages).status_code == 200


def test_requests_that_can_never_fit_are_400(app):
    body = error_of(complete(app, prompt=[5] * 1000, max_tokens=100), 400)
    assert body["code"] == "context_length_exceeded" and "1100" in body["message"]
    body = error_of(complete(app, prompt="hi", n=5), 400)  # 5 choices, the queue holds 4
    assert "more than the server queues at once (4)" in body["message"]
    for prompt in ("", [], [[]]):
        error_of(complete(app, prompt=prompt), 400)


def test_validation_comes_before_the_queue_check(app):
    metrics = app.app.state.client.metrics
    metrics.num_queued += 4  # the queue is full
    try:
        error_of(complete(app, prompt=[10**6]), 400)  # can never run: 400, not 429
        r = complete(app, prompt="hi")
        assert error_of(r, 429)["code"] == "too_many_requests"
        assert r.headers["Retry-After"] == "1"
    finally:
        metrics.num_queued -= 4
    assert complete(app, prompt="hi").status_code == 200


def test_templating_and_tokenizing_run_off_the_event_loop(app):
    client = app.app.state.client
    threads = []
    encode_chat, encode_text = client.encode_chat, client.encode_text

    def recorded(fn):
        def call(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return call

    client.encode_chat, client.encode_text = recorded(encode_chat), recorded(encode_text)
    try:
        assert chat(app, messages=HELLO).status_code == 200
        assert complete(app, prompt="hi").status_code == 200
    finally:
        client.encode_chat, client.encode_text = encode_chat, encode_text
    assert len(threads) == 2 and all(t.startswith("lmengine-tokenize") for t in threads)


def test_tokenizing_threads_take_tokenizer_copies_made_at_start(app, monkeypatch):
    """Each tokenizing thread has its own tokenizer, copied when the server started: the first
    burst (two requests at once start the second thread) does not wait for a deep copy."""
    shared = app.app.state.client
    context = ServerContext(shared.engine, shared.settings)  # a server's start: no thread yet
    copies = []
    monkeypatch.setattr(
        "lmengine.serve.client.copy.deepcopy", lambda obj: copies.append(obj) or obj
    )
    both = threading.Barrier(2, timeout=30)

    def tokenizer_of_this_thread():
        both.wait()  # both threads at once: the pool has to start two
        return context.local_tokenizer()

    async def two_at_once():
        return await asyncio.gather(*(context.off_loop(tokenizer_of_this_thread) for _ in "ab"))

    try:
        first, second = asyncio.run(two_at_once())
    finally:
        context.close()
    assert first is not second
    assert context.tokenizer not in (first, second)
    assert copies == []  # both made at start


def test_openapi_document_says_what_the_server_answers(app):
    doc = app.get("/openapi.json").json()
    paths = doc["paths"]
    chat_responses = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "429", "503"} <= set(chat_responses)
    assert all("422" not in op["responses"] for p in paths.values() for op in p.values())
    for path in ("/metrics", "/ping"):
        assert set(paths[path]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    prompt = json.dumps(doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"])
    assert '"minLength": 1' in prompt
    r = app.get("/v1/chat/completions", headers=AUTH)
    error_of(r, 405)
    assert r.headers["Allow"] == "POST"
    metrics = app.get("/metrics", headers=AUTH).text
    assert "# TYPE lmengine_kv_blocks_capacity gauge" in metrics
    assert "lmengine_kv_blocks_total" not in metrics


def test_shutdown_ends_every_request_with_a_readable_error(tiny_llama_path):
    """SIGTERM with requests running past the grace period: the stream ends with an error
    event and [DONE], the non-streaming request gets a JSON 503, the process exits 0."""
    proc, url = start_server(
        tiny_llama_path, "--api-keys", API_KEY, "--grace-period", "2", "--num-threads", "1",
        "--num-gpu-blocks", "512",
    )  # fmt: skip
    long = {"max_tokens": 900, "ignore_eos": True, "prompt": "Once"}
    results = {}

    def stream():
        with requests.post(
            f"{url}/v1/completions", headers=AUTH, json={**long, "stream": True}, stream=True
        ) as r:
            results["stream"] = [line for line in r.iter_lines(decode_unicode=True) if line]

    def whole():
        results["whole"] = requests.post(f"{url}/v1/completions", headers=AUTH, json=long)

    workers = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for w in workers:
        w.start()
    try:
        while not results.get("started"):  # both requests generating
            m = requests.get(f"{url}/metrics", headers=AUTH).text
            results["started"] = "lmengine_server_requests_in_flight 2" in m and (
                "lmengine_server_requests_queued 0" in m
            )
        proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.join(timeout=30)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert "shut down" in last["error"]["message"] and last["error"]["code"] == 503
    assert error_of(results["whole"], 503)["type"] == "service_unavailable"
