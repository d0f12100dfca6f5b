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

from lmengine.serve.tools import (
    TOOL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    ToolOutput,
    written_calls,
)
from tests.test_server import API_KEY, TINY_OPENAI_FLAGS, openai_client, tiny_server, wait_idle


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


def weather_call(call_id: str, city: str, result: str) -> list[dict]:
    """An assistant's get_weather call for `city` and the tool's `result`, as history."""
    arguments = json.dumps({"city": city})
    call = {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


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
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
                call["pieces"] += bool(d.function.arguments)
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
    assert all(x["pieces"] > 3 for x in calls.values())  # the arguments as they are written


@pytest.mark.parametrize(
    "tool_choice, max_tokens",  # cut after the function's name, in its arguments
    [("required", 20), ({"type": "function", "function": {"name": "get_weather"}}, 12)],
)
def test_a_call_cut_by_max_tokens_finishes_with_length(client, tool_choice, max_tokens):
    """As OpenAI answers: `finish_reason` "length" with the call as far as it was written
    (clients such as instructor read it to report an incomplete output), streamed the same."""
    c, _ = client
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    args.update(max_tokens=max_tokens, temperature=0)
    choice = c.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "length"
    ((call,),) = [choice.message.tool_calls]
    assert call.function.name in MODELS and choice.message.content is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    content, calls, reason = reassemble(c.chat.completions.create(**args, stream=True))
    assert reason == "length" and content == ""
    assert [(x["name"], x["arguments"]) for x in calls.values()] == [
        (call.function.name, call.function.arguments)
    ]


def test_tool_results_in_the_history_and_auto_and_none(client):
    c, _ = client
    history = [*MESSAGES, *weather_call("call_1", "Paris", '{"temperature": 21}')]
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
        (dict(tool_choice="required"), "tool_choice 'required' needs tools"),
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


def test_written_calls_follow_the_text_as_it_grows():
    text = '[{"name": "f", "arguments": {"a": "x\\"}"}}, {"name": "g", "arguments": {"b": [1, 2'
    (f, f_done), (g, g_done) = written_calls(text)
    assert (f.name, f.arguments, f_done) == ("f", '{"a": "x\\"}"}', True)
    assert (g.name, g.arguments, g_done) == ("g", '{"b": [1, 2', False)
    assert written_calls('[{"name": "f", "argu') == []


def test_streamed_calls_grow_piece_by_piece():
    out = ToolOutput("required", None, "hermes")
    text = '[{"name": "f", "arguments": {"city": "Paris"}}, {"name": "g", "arguments": {}}]'
    deltas = [out.delta(text[:end], end == len(text)) for end in range(1, len(text) + 1)]
    pieces = [d for _, calls in deltas for d in calls or []]
    opened = [d for d in pieces if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in opened] == [(0, "f"), (1, "g")]
    args = {0: "", 1: ""}
    for d in pieces:
        args[d["index"]] += d["function"]["arguments"]
    assert args == {0: '{"city": "Paris"}', 1: "{}"}
    assert sum(d["index"] == 0 for d in pieces) > 5 and out.called  # arguments as written


def test_auto_streams_content_then_the_call_then_content():
    out = ToolOutput("auto", None, "hermes")
    text = 'Checking. <tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>\nDone.'
    chunks = [out.delta(text[:end], end == len(text)) for end in range(1, len(text) + 1)]
    content = "".join(c for c, _ in chunks)
    calls = [d for _, ds in chunks for d in ds or []]
    assert content == "Checking. \nDone." and out.called
    assert "".join(d["function"]["arguments"] for d in calls) == '{"a": 1}'
    whole = ToolOutput("auto", None, "hermes").final(text)
    assert whole[0] == "Checking. \nDone." and whole[1][0].arguments == '{"a": 1}'


@pytest.mark.parametrize(
    "parser, opening, parallel",
    [("hermes", "<tool", True), ("hermes", "<tool", False), ("llama3_json", '{"name": ', False)],
)
def test_auto_calls_that_start_always_parse(tiny_llama_path, parser, opening, parallel):
    """Under `auto` the model decides; once it starts `<tool`, the structural tag finishes a
    valid call. The tiny random model is pushed into the opening by a logits processor and then
    left to itself (noise) for 16 seeds: every answer holds valid calls."""
    from lmengine.api import pipeline
    from lmengine.config import EngineConfig, GenerationConfig
    from lmengine.serve.protocol import Tool

    tools = [Tool.model_validate(t).function for t in TOOLS]
    spec = TOOL_PARSERS[parser]().auto_constraint(tools, parallel)
    with pipeline(tiny_llama_path, EngineConfig(num_gpu_blocks=256)) as pipe:
        opening = pipe.tokenizer(opening)["input_ids"]

        def start_a_call(token_ids, logits):
            done = len(token_ids) - len(prompt)
            if done < len(opening):
                logits[opening[done]] += 1e4
            return logits

        prompt = pipe.encode(MESSAGES)
        configs = [
            GenerationConfig(
                max_new_tokens=160,
                do_sample=True,
                random_seed=seed,
                structured_outputs=spec,
                logits_processors=[start_a_call],
            )
            for seed in range(16)
        ]
        outs = pipe([prompt] * len(configs), configs)
    for out in outs:
        content, calls = TOOL_PARSERS[parser]().parse(out.text)
        assert calls and (parallel or len(calls) == 1), repr(out.text)
        for call in calls:
            MODELS[call.name].model_validate_json(call.arguments)
        if not parallel:  # one call, then the end (free text may follow parallel calls)
            assert out.finish_reason == "stop" and content is None, out.text


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
EARLIER_CALL = [  # one earlier exchange with the tool, as an agent's history has
    {"role": "user", "content": "What's the weather in Berlin?"},
    *weather_call("call_0", "Berlin", '{"temperature": 12, "sky": "cloudy"}'),
    {"role": "assistant", "content": "It is 12 °C and cloudy in Berlin."},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    with tiny_server(smollm2_path, "--api-keys", API_KEY, "--num-gpu-blocks", "512") as url:
        yield openai_client(url)


@pytest.mark.parametrize(
    "question, city",
    [
        ("What is the weather like in Paris today?", "Paris"),
        ("What's the weather in Tokyo?", "Tokyo"),
        ("Is it raining in London right now?", "London"),
        ("Write a haiku about the sea.", None),
        ("What is 2 + 2?", None),
    ],
)
def test_smollm2_calls_the_tool_when_the_question_needs_it(smollm2, question, city):
    """SmolLM2-135M under `auto`, greedy: a weather question is answered with a call of the
    weather tool for that city; other questions with text."""
    args = dict(
        model="SmolLM2-135M-Instruct",
        messages=[*EARLIER_CALL, {"role": "user", "content": question}],
        tools=[WEATHER_TOOL],
        max_tokens=48,
        temperature=0,
    )
    message = smollm2.chat.completions.create(**args).choices[0].message
    if city is None:
        assert message.tool_calls is None and message.content
        return
    ((call,),) = [message.tool_calls]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": city}
    content, calls, reason = reassemble(smollm2.chat.completions.create(**args, stream=True))
    assert reason == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", call.function.arguments)
    ]
