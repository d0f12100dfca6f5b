"""Scoring over HTTP: /v1/completions with `echo` + `logprobs` (OpenAI's legacy object over
prompt and completion, `max_tokens=0`), vLLM's `prompt_logprobs`, and /tokenize,
/detokenize, /tokenizer_info in vLLM's shapes, against transformers' forward."""

from __future__ import annotations

import json

import pytest

from tests.engine_utils import random_prompts
from tests.hf_reference import hf_forward
from tests.test_server import API_KEY, httpx, tiny_server, wait_idle

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with tiny_server(
        tiny_llama_path,
        "--api-keys", API_KEY,
        "--session-len", "256",
        "--num-gpu-blocks", "256",
        "--max-prefill-token-num", "24",  # long prompts are scored in chunks
    ) as url:  # fmt: skip
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=HEADERS, timeout=120)


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer, `[DONE]` left out."""
    events = []
    with httpx.stream("POST", url + path, json=body, headers=HEADERS, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_echo_logprobs_score_the_prompt_as_transformers(server, tiny_llama_path):
    prompts = random_prompts([37, 12, 58], 49152, seed=21)
    r = post(
        server,
        "/v1/completions",
        {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        lp, _ = hf_forward(tiny_llama_path, ids)
        body = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert len(body["tokens"]) == len(ids)
        assert body["token_logprobs"][0] is None and body["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(body["token_logprobs"][i] - lp[i - 1, ids[i]].item()) < TOL
            top = body["top_logprobs"][i]
            assert abs(max(top.values()) - lp[i - 1].max().item()) < TOL
            assert len(top) <= 2
        offsets = body["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert choice["text"].startswith("".join(body["tokens"])[:5])


def test_echo_with_one_generated_token_as_lm_eval_asks(server, tiny_llama_path):
    """lm-evaluation-harness: max_tokens=1, logprobs=1, echo; it reads token_logprobs[ctx:-1]
    and compares each with the top logprob for is_greedy."""
    ids = random_prompts([25], 49152, seed=22)[0]
    r = post(
        server,
        "/v1/completions",
        {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]["logprobs"]
    lp, _ = hf_forward(tiny_llama_path, ids)
    assert len(body["token_logprobs"]) == len(ids) + 1
    generated = body["token_logprobs"][-1]
    assert abs(generated - lp[-1].max().item()) < TOL  # greedy: the top token
    for i in range(1, len(ids)):
        is_top = lp[i - 1].argmax().item() == ids[i]
        # the same float when the prompt token is the top one (lm-eval's is_greedy)
        assert (body["token_logprobs"][i] == max(body["top_logprobs"][i].values())) == is_top


def test_prompt_logprobs_extension_and_streaming(server, tiny_llama_path):
    ids = random_prompts([30], 49152, seed=23)[0]
    lp, _ = hf_forward(tiny_llama_path, ids)
    r = post(server, "/v1/completions", {"prompt": ids, "prompt_logprobs": 3, "max_tokens": 2})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        assert abs(entry[str(ids[i])]["logprob"] - lp[i - 1, ids[i]].item()) < TOL
        ranked = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] is not None)
        assert [t for _, t in ranked] == lp[i - 1].topk(3).indices.tolist()
    # streamed: the echo and its logprobs ride in the first chunk
    body = {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 3, "stream": True}
    events = stream_events(server, "/v1/completions", body)
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    assert len(first["token_logprobs"]) >= len(ids)
    assert abs(first["token_logprobs"][5] - lp[4, ids[5]].item()) < TOL
    total = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"])
    assert total == len(ids) + 3


def test_tokenizer_endpoints_in_vllm_shapes(server, tiny_llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    r = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok("Hello world")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    want = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    )
    assert chat["tokens"] == list(want)
    r = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    info = httpx.get(server + "/tokenizer_info", headers=HEADERS).json()
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == 256
    assert info["chat_template"] == tok.chat_template


TOO_LONG = {"prompt": list(range(3, 300)), "echo": True, "logprobs": 1, "max_tokens": 0}
BOTH = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/tokenize", BOTH, 400, "exactly one"),
        ("/tokenize", {}, 400, "exactly one"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "does not exist"),
        ("/detokenize", {"tokens": [10**6]}, 400, "outside the vocabulary"),
        ("/v1/completions", TOO_LONG, 400, "context is 256 tokens"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ],
)
def test_bad_scoring_requests_are_400_and_the_server_goes_on(server, path, body, status, message):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert message in r.text
    assert wait_idle(server)["lmengine_kv_blocks_used"] == 0
    ok = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_chat_prompt_logprobs_whole_and_streamed(server, tiny_llama_path):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Score this sentence, please."}]
    ids = list(
        AutoTokenizer.from_pretrained(tiny_llama_path).apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
    )
    lp, _ = hf_forward(tiny_llama_path, ids)
    body = {"messages": messages, "prompt_logprobs": 1, "max_tokens": 2}
    whole = post(server, "/v1/chat/completions", body).json()["prompt_logprobs"]
    events = stream_events(server, "/v1/chat/completions", {**body, "stream": True})
    streamed = [e["choices"][0]["prompt_logprobs"] for e in events if "prompt_logprobs" in str(e)]
    assert streamed == [whole]
    assert whole[0] is None and len(whole) == len(ids)
    for i in range(1, len(ids)):
        assert abs(whole[i][str(ids[i])]["logprob"] - lp[i - 1, ids[i]].item()) < TOL
