"""Tool calling over HTTP with the official `openai` client: `tool_choice="required"` and a
named function constrain the output so that the calls always parse and validate (the tiny
random model, which unconstrained writes noise), streamed calls reassemble to the same calls,
tool results in the history, `auto` and `none`, bad tool requests; and the tool-call parsers."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from lmengine.serve.tools import HermesParser, Llama3JsonParser
from tests.test_server import TINY_OPENAI_FLAGS, openai_client, tiny_server, wait_idle


class Weather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class Search(BaseModel):
    query: str = Field(max_length=20)
    limit: int


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": Weather.model_json_schema(),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": Search.model_json_schema(),
        },
    },
]
MODELS = {"get_weather": Weather, "search": Search}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
BAD_FUNCTION = {"name": "f", "parameters": {"type": "nope"}}


@pytest.fixture(scope="module")
def client(tiny_llama_path):
    with tiny_server(tiny_llama_path, *TINY_OPENAI_FLAGS) as url:
        yield openai_client(url), url


def check_calls(calls, max_calls: int | None = None, name: str | None = None) -> None:
    assert calls, "no tool call"
    if max_calls is not None:
        assert len(calls) <= max_calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert name is None or call.function.name == name
        MODELS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_valid_calls(client, parallel):
    c, _ = client
    for seed in range(4):
        r = c.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=300,
            seed=seed,
            temperature=1.0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        check_calls(choice.message.tool_calls, None if parallel else 1)


def test_named_function_gives_its_call(client):
    c, _ = client
    r = c.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}},
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, 1, "search")


def reassemble(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls by index (OpenAI's streaming protocol) and the finish reason."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_reassemble_to_the_same_calls(client, tool_choice):
    c, _ = client
    args = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
    )
    whole = c.chat.completions.create(**args)
    content, calls, reason = reassemble(c.chat.completions.create(**args, stream=True))
    want = whole.choices[0].message.tool_calls
    assert reason == "tool_calls" and content == ""
    assert [(x["name"], x["arguments"]) for x in calls.values()] == [
        (w.function.name, w.function.arguments) for w in want
    ]
    assert all(x["id"] for x in calls.values())


def test_tool_results_in_the_history_and_auto_and_none(client):
    c, _ = client
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    for choice in ("auto", "none"):
        r = c.chat.completions.create(
            model="tiny", messages=history, tools=TOOLS, tool_choice=choice, max_tokens=8
        )
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        if choice == "none":
            assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "unknown function 'nope'"),
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=[{"type": "function", "function": BAD_FUNCTION}], tool_choice="required"),
         "does not compile"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(client, kwargs, message):
    c, url = client
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
    assert message in str(err.value)
    assert wait_idle(url)["lmengine_kv_blocks_used"] == 0


def test_hermes_parser():
    parse = HermesParser().parse
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1})
    ]
    pair = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": "y"}}]'
    content, calls = parse(f"<tool_call>{pair}</tool_call>")
    assert content is None and [c.name for c in calls] == ["f", "g"]
    block = '<tool_call>{{"name": "{}", "arguments": {{}}}}</tool_call>'
    two = block.format("f") + block.format("g")
    assert [c.name for c in parse(two)[1]] == ["f", "g"]
    assert parse("no calls <tool_call>not json</tool_call>") == (
        "no calls <tool_call>not json</tool_call>",
        [],
    )


def test_llama3_json_parser():
    parse = Llama3JsonParser().parse
    content, calls = parse(
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    )
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]
    assert parse("Hello there") == ("Hello there", [])
    assert parse('{"name": "f", "parameters": {"a": 1}} trailing words') == (
        '{"name": "f", "parameters": {"a": 1}} trailing words',
        [],
    )


def test_auto_streams_content_until_a_call_starts():
    from lmengine.serve.tools import ToolOutput

    out = ToolOutput("auto", None, "hermes")
    steps = ["Let me", "Let me check. <tool", 'Let me check. <tool_call>{"name": "f", "argu']
    assert [out.delta(t, False) for t in steps] == [
        ("Let me", None),
        (" check. ", None),  # "<tool" may start a call: held back
        ("", None),
    ]
    text = steps[-1] + 'ments": {"a": 1}}</tool_call>'
    content, calls = out.delta(text, True)
    assert content == "" and [c["function"]["name"] for c in calls] == ["f"]
    plain = ToolOutput("auto", None, "hermes")
    assert plain.delta("a <t", False) == ("a ", None)
    assert plain.delta("a <t> c", True) == ("<t> c", None)  # no call after all: all of it
