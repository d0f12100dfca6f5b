"""The server's limits and lifecycle, on a second tiny server with one sequence per batch:
--max-queued-requests (429 + Retry-After), --request-timeout (504, blocks freed),
--chat-template FILE, QoS endpoints off without a QoS config, graceful SIGTERM (the running
stream finishes, the process exits 0)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.test_server import httpx, metrics, start_server, wait_idle

TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def limited(tiny_llama_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    proc, url = start_server(
        tiny_llama_path,
        "--max-batch-size", "1",
        "--num-threads", "1",
        "--max-queued-requests", "30",
        "--request-timeout", "8",
        "--grace-period", "20",
        "--chat-template", str(template),
    )  # fmt: skip
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_queue_limit_429_then_timeout_504_frees_blocks(limited):
    # one sequence per batch: A's 16 choices of 1000 tokens run one after another, far longer
    # than the 8 s timeout on any machine; B queues behind them; C is over the queue limit.
    proc, url = limited
    long = {"prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    results = {}

    def stream_a():
        body = {**long, "stream": True, "n": 16}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            results["a"] = (r.status_code, [line for line in r.iter_lines() if line])

    def wait_b():
        results["b"] = httpx.post(url + "/v1/completions", json={**long, "n": 14}, timeout=30)

    a = threading.Thread(target=stream_a)
    a.start()
    until(lambda: metrics(url)["lmengine_server_requests_queued"] == 15)
    b = threading.Thread(target=wait_b)
    b.start()
    until(lambda: metrics(url)["lmengine_server_requests_queued"] == 29)
    c = httpx.post(url + "/v1/completions", json={**long, "n": 2}, timeout=30)
    assert c.status_code == 429 and c.headers["retry-after"] == "1"
    assert c.json()["error"]["code"] == "too_many_requests"
    a.join(30)
    b.join(30)
    status, lines = results["a"]
    assert status == 200 and lines[0].startswith("data: ")
    assert '"timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert results["b"].status_code == 504
    assert results["b"].json()["error"]["type"] == "timeout"
    m = wait_idle(url)
    assert m["lmengine_kv_blocks_used"] == 0 and m["lmengine_server_requests_queued"] == 0


def test_chat_template_file_and_qos_off(limited, tiny_llama_path):
    from transformers import AutoTokenizer

    _, url = limited
    r = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    want = tokenizer("<<user>> hello there\n<<assistant>>")["input_ids"]
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    for path in ("/v1/chat/completions_qos", "/v1/completions_qos", "/v1/chat/interactive_qos"):
        r = httpx.post(url + path, json={"prompt": "x"})
        assert r.status_code == 404 and "qos" in r.json()["error"]["message"].lower()
        assert path not in httpx.get(url + "/openapi.json").json()["paths"]


def test_sigterm_finishes_running_stream_and_exits_0(limited):
    proc, url = limited
    body = {"prompt": "x", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert first.startswith("data: ")
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    assert proc.wait(timeout=30) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_serve_help_lists_every_engine_field_and_server_flag():
    import dataclasses

    from lmengine.cli import build_parser
    from lmengine.config import EngineConfig

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in text
    for flag in ("--api-keys", "--max-queued-requests", "--request-timeout", "--chat-template",
                 "--grace-period", "--host", "--port"):  # fmt: skip
        assert flag in text
    args = parser.parse_args(["serve", "some/model", "--block-size", "4", "--api-keys", "a", "b"])
    assert args.model_path == "some/model" and args.api_keys == ["a", "b"]
    assert getattr(args, "EngineConfig.block_size") == 4
