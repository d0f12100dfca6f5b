"""The server's limits and lifecycle, on a second server, SmolLM2 with one sequence per batch:
real text through a `--chat-template FILE`, --max-queued-requests (429 + Retry-After),
--request-timeout (504, blocks freed), QoS endpoints off without a QoS config, graceful
SIGTERM (the running stream finishes, the process exits 0)."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from tests.test_server import httpx, metrics, start_server, wait_idle

# SmolLM2's ChatML without its default system prompt
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def limited(smollm2_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    proc, url = start_server(
        smollm2_path,
        "--max-batch-size", "1",
        "--num-threads", "1",
        "--num-gpu-blocks", "1024",  # mapping the default pool at start took 22 s of the run
        "--max-queued-requests", "30",
        "--request-timeout", "8",
        "--grace-period", "20",
        "--chat-template", str(template),
        "--served-model-name", "SmolLM2",
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


def test_real_text_through_the_chat_template_file(limited, smollm2_path):
    from transformers import AutoTokenizer

    _, url = limited
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model="SmolLM2", messages=messages, max_tokens=20, temperature=0
    )
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model="SmolLM2", messages=messages, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    want = AutoTokenizer.from_pretrained(smollm2_path).apply_chat_template(
        messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    assert r.usage.prompt_tokens == len(want)  # the file's template, not the tokenizer's


def test_qos_endpoints_are_off_without_a_qos_config(limited):
    _, url = limited
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    for path in ("/v1/chat/completions_qos", "/v1/completions_qos", "/v1/chat/interactive_qos"):
        r = httpx.post(url + path, json={"prompt": "x"})
        assert r.status_code == 404 and "qos" in r.json()["error"]["message"].lower()
        assert path not in paths


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


def test_a_server_maps_its_kv_pool_at_start_unless_told_not_to():
    from lmengine.cli import build_parser
    from lmengine.config import EngineConfig
    from lmengine.flags import build_dataclass
    from lmengine.serve.server import SERVE_ENGINE_DEFAULTS

    parser = build_parser()

    def served(*flags: str) -> EngineConfig:
        args = parser.parse_args(["serve", "some/model", *flags])
        return build_dataclass(EngineConfig, args, SERVE_ENGINE_DEFAULTS)

    assert served().prefault_kv_cache and served().max_prefill_token_num == 2048
    assert not served("--no-prefault-kv-cache").prefault_kv_cache
    offline = build_dataclass(EngineConfig, parser.parse_args(["generate", "hi"]))
    assert not offline.prefault_kv_cache and not EngineConfig().prefault_kv_cache
