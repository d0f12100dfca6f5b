"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) of a real
`lmengine serve` process, driven by the official `anthropic` client: whole and streamed
answers alike, stop reasons, tool calls constrained on the tiny random model (any, a named
tool) and chosen by SmolLM2 under auto, tool results in the history, token counts, and
every error in Anthropic's shape; the server is idle afterwards."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.test_server import (
    API_KEY,
    TINY_OPENAI_FLAGS,
    httpx,
    metrics,
    tiny_server,
    wait_idle,
)
from tests.test_server_tools import MODELS, Search, Weather

TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather in a city",
        "input_schema": Weather.model_json_schema(),
    },
    {"name": "search", "description": "Search the web", "input_schema": Search.model_json_schema()},
]
STORY = [{"role": "user", "content": "Tell me a story."}]
# NOTE: the client names no sampling fields (newer Claude models take none): sent as extras
GREEDY = dict(model="tiny", max_tokens=16, extra_body={"temperature": 0})


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with tiny_server(tiny_llama_path, *TINY_OPENAI_FLAGS) as url:
        yield url


def anthropic_client(url: str, api_key: str = API_KEY) -> anthropic.Anthropic:
    """The official client of a test server (it sends the key as `x-api-key`), no retries."""
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return anthropic_client(server)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def streamed(client, **args):
    """(the events, the final message) of `messages.stream(**args)`."""
    with client.messages.stream(**args) as stream:
        events = list(stream)
        return events, stream.get_final_message()


# ---- text ---------------------------------------------------------------------------------------
def test_create_and_stream_give_the_same_message(client):
    whole = client.messages.create(messages=STORY, system="Be brief.", **GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "tiny"
    assert whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 16 and whole.usage.input_tokens > 0
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    events, final = streamed(client, messages=STORY, system="Be brief.", **GREEDY)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_delta" in kinds
    pieces = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(pieces) == whole.content[0].text == text_of(final)
    assert final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == 16


def test_stop_sequences_end_the_message(client):
    text = client.messages.create(messages=STORY, **GREEDY).content[0].text
    word = text[len(text) // 2 :][:3]
    assert word.strip(), text
    expected = text[: text.index(word)]
    message = client.messages.create(messages=STORY, stop_sequences=[word], **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert text_of(message) == expected
    _, final = streamed(client, messages=STORY, stop_sequences=["zzzz", word], **GREEDY)
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == (
        "stop_sequence",
        word,
        expected,
    )


def test_count_tokens_is_the_prompt_of_the_request(client):
    counts = []
    for args in (
        dict(messages=STORY),
        dict(messages=STORY, system=[{"type": "text", "text": "Be brief."}], tools=TOOLS),
        dict(messages=STORY, tools=TOOLS, tool_choice={"type": "none"}),  # tools left out
    ):
        counted = client.messages.count_tokens(model="tiny", **args).input_tokens
        used = client.messages.create(**GREEDY, **args)
        assert counted == used.usage.input_tokens > 0
        counts.append(counted)
    assert counts[1] > counts[0] == counts[2]  # the tools are in the prompt


# ---- tools --------------------------------------------------------------------------------------
def check_tool_use(message, name: str | None = None, max_calls: int | None = None) -> list:
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use", message
    assert max_calls is None or len(calls) <= max_calls
    for call in calls:
        assert call.id.startswith("toolu_") and (name is None or call.name == name)
        MODELS[call.name].model_validate(call.input)  # the constraint held
    return calls


@pytest.mark.parametrize(
    "choice, name",
    [
        ({"type": "tool", "name": "get_weather"}, "get_weather"),
        ({"type": "any", "disable_parallel_tool_use": True}, None),
    ],
)
def test_tool_use_whole_and_streamed(client, choice, name):
    args = dict(GREEDY, max_tokens=128, messages=STORY, tools=TOOLS, tool_choice=choice)
    calls = check_tool_use(client.messages.create(**args), name, max_calls=1)
    events, final = streamed(client, **args)
    streamed_calls = check_tool_use(final, name)
    assert [(c.name, c.input) for c in streamed_calls] == [(c.name, c.input) for c in calls]
    for index, call in enumerate(final.content):
        pieces = [
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.index == index
        ]
        assert json.loads("".join(pieces)) == call.input


@pytest.mark.parametrize("parallel", [False, True])
def test_any_tool_sampled_gives_valid_calls(client, parallel):
    """Sampled noise under `any`: one call ends the message (its arguments are bounded, so well
    within max_tokens); parallel calls may follow each other until max_tokens cuts the last."""
    choice = {"type": "any", "disable_parallel_tool_use": not parallel}
    args = dict(model="tiny", max_tokens=300, messages=STORY, tools=TOOLS, tool_choice=choice)
    for _ in range(4):
        message = client.messages.create(**args)
        if message.stop_reason != "max_tokens" or not parallel:
            check_tool_use(message, max_calls=None if parallel else 1)
            continue
        calls = [b for b in message.content if b.type == "tool_use"]
        assert len(calls) > 1 and message.usage.output_tokens == 300, message
        for call in calls[:-1]:  # whole calls before the cut one
            MODELS[call.name].model_validate(call.input)


def test_tool_result_in_the_history_is_answered_with_text(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(GREEDY, max_tokens=64, tools=TOOLS)
    first = client.messages.create(
        **args, messages=question, tool_choice={"type": "tool", "name": "get_weather"}
    )
    (call,) = check_tool_use(first, "get_weather")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}
    history = [
        *question,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result, {"type": "text", "text": "Thanks!"}]},
    ]
    second = client.messages.create(**args, messages=history, tool_choice={"type": "none"})
    assert [b.type for b in second.content] == ["text"] and second.stop_reason == "max_tokens"
    failed = [{**result, "is_error": True, "content": [{"type": "text", "text": "no network"}]}]
    history[-1] = {"role": "user", "content": failed}
    counted = client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    assert counted.input_tokens > 0


# ---- errors -------------------------------------------------------------------------------------
def anthropic_error(resp, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]["message"]


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=0, messages=STORY)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError, match="image and document blocks"):
        client.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    in_result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}
    with pytest.raises(anthropic.BadRequestError, match="image and document blocks"):
        client.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": [in_result]}]
        )
    with pytest.raises(anthropic.BadRequestError, match="server tools"):
        client.messages.create(
            **GREEDY, messages=STORY, tools=[{"type": "web_search_20250305", "name": "web_search"}]
        )
    with pytest.raises(anthropic.BadRequestError, match="needs tools|tools"):
        client.messages.create(**GREEDY, messages=STORY, tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(model="tiny", max_tokens=10**6, messages=STORY)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=STORY)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=STORY)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic_client(server, "wrong").messages.create(**GREEDY, messages=STORY)
    assert denied.value.body["error"]["type"] == "authentication_error"

    key = {"x-api-key": API_KEY}
    url = server + "/v1/messages"
    message = anthropic_error(httpx.post(url, json={"model": "tiny"}, headers=key), 400,
                              "invalid_request_error")  # fmt: skip
    assert "messages" in message and "max_tokens" in message
    r = httpx.post(url, json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "system",
                   "content": "x"}]}, headers=key)  # fmt: skip
    assert "role is user or assistant" in anthropic_error(r, 400, "invalid_request_error")
    r = httpx.post(url, content=b'{"model": ', headers={**key, "content-type": "application/json"})
    anthropic_error(r, 400, "invalid_request_error")
    anthropic_error(httpx.post(url, json={}), 401, "authentication_error")
    big = b'{"model": "' + b"x" * (5 << 20) + b'"}'
    r = httpx.post(url + "/count_tokens", content=big, headers=key)
    anthropic_error(r, 413, "request_too_large")
    anthropic_error(httpx.post(url + "/nothing", json={}, headers=key), 404, "not_found_error")
    # the OpenAI routes keep OpenAI's shape, and take the x-api-key header too
    r = httpx.post(server + "/v1/chat/completions", json={"messages": []}, headers=key)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert httpx.get(server + "/v1/models", headers=key).status_code == 200
    assert httpx.get(server + "/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


def test_server_is_idle_and_counted_after_all(server):
    m = wait_idle(server)
    assert m["lmengine_kv_blocks_used"] == 0
    assert m["lmengine_server_requests_in_flight"] == 0
    finished = [k for k in metrics(server) if 'endpoint="messages"' in k]
    assert finished, "no finished request counted under the messages endpoint"


def test_openapi_documents_the_messages_routes(server):
    doc = httpx.get(server + "/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = doc["paths"][path]["post"]["responses"]
        schema = responses["400"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/AnthropicErrorBody"), schema


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_the_document_and_the_server_agree_on_what_needs_tools(server, path):
    """A forced tool choice without tools is refused, and the document says so; a null or
    auto choice with no tools is accepted, and the document says so too (a null choice once
    met the "forced" rule vacuously: the schema fuzz found the server accepting a body its
    document refused)."""
    import jsonschema

    doc = httpx.get(server + "/openapi.json").json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**ref, "components": doc["components"]})
    base = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": API_KEY}
    for choice, valid in ((None, True), ({"type": "auto"}, True), ({"type": "any"}, False)):
        body = {**base, "tools": [], "tool_choice": choice}
        assert validator.is_valid(body) == valid, choice
        status = httpx.post(server + path, json=body, headers=headers, timeout=60).status_code
        assert (status == 200) == valid, (choice, status)


# ---- SmolLM2 chooses the tool under auto ---------------------------------------------------------
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a given city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name"}},
        "required": ["city"],
    },
}
BERLIN = {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Berlin"}}
EARLIER_CALL = [  # one earlier exchange with the tool, as an agent's history has
    {"role": "user", "content": "What's the weather in Berlin?"},
    {"role": "assistant", "content": [BERLIN]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0",
                                  "content": '{"temperature": 12, "sky": "cloudy"}'}]},
    {"role": "assistant", "content": "It is 12 °C and cloudy in Berlin."},
]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with tiny_server(smollm2_path, "--api-keys", API_KEY, "--num-gpu-blocks", "512") as url:
        yield anthropic_client(url)


def test_smollm2_calls_the_tool_then_answers_its_result(smollm2):
    """SmolLM2-135M under auto, greedy: a weather question is answered with a tool_use of the
    weather tool, whole and streamed alike; given the result, it answers in text and ends
    its turn."""
    question = [*EARLIER_CALL, {"role": "user", "content": "What is the weather like in Paris?"}]
    args = dict(model="SmolLM2-135M-Instruct", max_tokens=48, tools=[WEATHER_TOOL],
                extra_body={"temperature": 0})  # fmt: skip
    first = smollm2.messages.create(**args, messages=question)
    assert first.stop_reason == "tool_use", first
    ((call,),) = [[b for b in first.content if b.type == "tool_use"]]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    events, final = streamed(smollm2, **args, messages=question)
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Paris"})
    ]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 18}'}
    history = [
        *question,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = smollm2.messages.create(**args, messages=history)
    assert second.stop_reason == "end_turn", second
    assert [b.type for b in second.content] == ["text"] and "18" in second.content[0].text


def test_a_failure_mid_stream_is_an_error_event():
    """The events of a message whose generation fails after its first token: Anthropic's
    `error` event (no `message_stop`)."""
    import asyncio
    from types import SimpleNamespace

    from lmengine.engine.request import STEP_FAILED, Response
    from lmengine.serve.anthropic import MessageAnswer
    from lmengine.serve.anthropic_protocol import MessagesRequest
    from lmengine.serve.client import ServerContext

    deltas = [Response(text="Once", input_token_len=5, generate_token_len=1),
              Response(finish_reason="error", error=f"{STEP_FAILED}: boom")]  # fmt: skip

    class FakeJob:
        choices = [SimpleNamespace(first=deltas[0], final=None)]

        async def responses(self):
            for delta in deltas:
                yield 0, delta

    client = SimpleNamespace(
        settings=SimpleNamespace(tool_call_parser="hermes"),
        usage=ServerContext.usage,
        model_name=lambda body: body.model,
    )
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": STORY})
    answer = MessageAnswer(client, body, FakeJob(), ("none", None))  # type: ignore[arg-type]

    async def collect():
        return [event async for event in answer.events()]

    events = [e.split("\n")[:2] for e in asyncio.run(collect())]
    kinds = [kind.removeprefix("event: ") for kind, _ in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "error"]  # fmt: skip
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "boom" in error["error"]["message"]
