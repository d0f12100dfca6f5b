"""Agent and LLM frameworks against `lmengine serve`, each written as its documentation shows
users writing it: langchain-openai's `ChatOpenAI`, pydantic-ai's `Agent` over
`OpenAIChatModel`, and instructor over the official `openai` client.

One SmolLM2-135M-Instruct server answers every test greedily: text, streamed text, tool calls
(under `auto` after an earlier exchange with the tool, as an agent's history has, or forced
by `tool_choice`), a whole agent loop (call, tool result, answer), and structured output
through each framework's methods (a JSON schema `response_format`, a forced tool call or JSON
mode, all grammar-constrained), validated by the framework against its pydantic model.
Retries are off and every request has a timeout, so that a failure fails fast.
"""

from __future__ import annotations

import json

import instructor
import openai
import pytest
from instructor.core.exceptions import IncompleteOutputException
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.messages import (
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits

from tests.test_server import API_KEY, tiny_server, wait_idle

MODEL = "SmolLM2-135M-Instruct"  # the served name: the checkpoint's folder
TIMEOUT = 60.0  # seconds, per request
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
WEATHER_QUESTION = "What is the weather like in Paris today?"
EXTRACT = "Alice is 30 years old. Extract the person."


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


class GetWeather(BaseModel):
    """Get the current weather in a given city."""

    city: str = Field(max_length=20)


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a given city."""
    return json.dumps({"temperature": 21, "sky": "sunny"})


@pytest.fixture(scope="module")
def url(smollm2_path):
    with tiny_server(smollm2_path, "--api-keys", API_KEY, "--num-gpu-blocks", "512") as url:
        yield url


# --- langchain-openai -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(url):
    return ChatOpenAI(
        base_url=url + "/v1",
        api_key=API_KEY,
        model=MODEL,
        temperature=0,
        max_tokens=48,
        max_retries=0,
        timeout=TIMEOUT,
        stream_usage=True,  # streams ask for a usage chunk (stream_options.include_usage)
    )


def joined(chunks):
    """langchain's streamed message chunks added up into one message."""
    message = chunks[0]
    for chunk in chunks[1:]:
        message += chunk
    return message


def test_langchain_invoke_and_stream(chat):
    message = chat.invoke(QUESTION)
    assert isinstance(message, AIMessage) and message.content == ANSWER
    assert message.response_metadata["finish_reason"] == "stop"
    streamed = joined(list(chat.stream(QUESTION)))
    assert streamed.content == message.content
    assert streamed.usage_metadata["output_tokens"] == message.usage_metadata["output_tokens"]


WEATHER_HISTORY = [  # one earlier exchange with the tool, as an agent's history has
    HumanMessage("What's the weather in Berlin?"),
    AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Berlin"}, "id": "call_0"}]),
    ToolMessage('{"temperature": 12, "sky": "cloudy"}', tool_call_id="call_0"),
    AIMessage("It is 12 °C and cloudy in Berlin."),
    HumanMessage(WEATHER_QUESTION),
]


def test_langchain_tool_call_under_auto(chat):
    """A @tool function; SmolLM2 decides to call it, whole and streamed."""
    model = chat.bind_tools([get_weather])
    message = model.invoke(WEATHER_HISTORY)
    ((call,),) = [message.tool_calls]
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    assert message.response_metadata["finish_reason"] == "tool_calls"
    streamed = joined(list(model.stream(WEATHER_HISTORY)))
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    assert not streamed.content


@pytest.mark.parametrize(
    "kwargs",
    [dict(tool_choice="GetWeather"), dict(tool_choice="any", strict=True)],
    ids=["named", "any-strict"],
)
def test_langchain_forced_tool_call(chat, kwargs):
    """A pydantic tool forced by name, or by "any" (OpenAI's "required") with strict
    schemas: the call's arguments validate."""
    message = chat.bind_tools([GetWeather], parallel_tool_calls=False, **kwargs).invoke(
        WEATHER_QUESTION
    )
    ((call,),) = [message.tool_calls]
    assert call["name"] == "GetWeather"
    assert GetWeather.model_validate(call["args"]) == GetWeather(city="Paris")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat, method):
    """`with_structured_output`: its default (a JSON schema response format) and a forced
    function call."""
    person = chat.with_structured_output(Person, method=method).invoke(EXTRACT)
    assert person == Person(name="Alice", age=30)


# --- pydantic-ai ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_model(url):
    provider = OpenAIProvider(base_url=url + "/v1", api_key=API_KEY)
    return OpenAIChatModel(MODEL, provider=provider)


SETTINGS = ModelSettings(temperature=0, max_tokens=64, timeout=TIMEOUT)
LIMITS = UsageLimits(request_limit=3)


def test_pydantic_ai_text_agent(agent_model):
    agent = Agent(agent_model, model_settings=SETTINGS, retries=0)
    result = agent.run_sync(QUESTION, usage_limits=LIMITS)
    assert result.output == ANSWER
    streamed = agent.run_stream_sync(QUESTION, usage_limits=LIMITS)
    assert "".join(streamed.stream_text(delta=True)) == ANSWER


@pytest.mark.parametrize("output_type", [Person, NativeOutput(Person)], ids=["tool", "native"])
def test_pydantic_ai_structured_output(agent_model, output_type):
    """`output_type`: its default (a `final_result` tool under `tool_choice="required"`) and
    native structured output (a JSON schema response format)."""
    agent = Agent(agent_model, output_type=output_type, model_settings=SETTINGS, retries=0)
    person = agent.run_sync(EXTRACT, usage_limits=LIMITS).output
    assert isinstance(person, Person) and person.age == 30


def test_pydantic_ai_agent_calls_its_tool_and_answers(agent_model):
    """The agent loop: SmolLM2 calls the agent's tool, reads its result and answers."""
    agent = Agent(agent_model, model_settings=SETTINGS, retries=0)
    cities = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        cities.append(city)
        return json.dumps({"temperature": 21, "sky": "sunny"})

    history = [
        ModelRequest(parts=[UserPromptPart("What's the weather in Berlin?")]),
        ModelResponse(parts=[ToolCallPart("get_weather", {"city": "Berlin"}, "call_0")]),
        ModelRequest(
            parts=[ToolReturnPart("get_weather", {"temperature": 12, "sky": "cloudy"}, "call_0")]
        ),
        ModelResponse(parts=[TextPart("It is 12 °C and cloudy in Berlin.")]),
    ]
    result = agent.run_sync(WEATHER_QUESTION, message_history=history, usage_limits=LIMITS)
    assert cities == ["Paris"]
    assert "21" in result.output and "Paris" in result.output


# --- instructor -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_sync(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA, instructor.Mode.JSON]
)
def test_instructor_response_model(openai_sync, mode):
    """Its default mode (a forced tool call), a JSON schema response format and JSON mode
    (the schema in the system prompt, any JSON object)."""
    client = instructor.from_openai(openai_sync, mode=mode)
    person = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        messages=[{"role": "user", "content": EXTRACT}],
        max_retries=0,
        temperature=0,
        max_tokens=64,
    )
    assert isinstance(person, Person) and person.model_dump() == {"name": "Alice", "age": 30}


def test_instructor_reports_a_call_cut_by_max_tokens(openai_sync):
    """A forced call cut by `max_tokens` finishes with "length", which instructor reports as
    an incomplete output (not as arguments that fail to validate)."""
    client = instructor.from_openai(openai_sync)
    with pytest.raises(IncompleteOutputException):
        client.chat.completions.create(
            model=MODEL,
            response_model=Person,
            messages=[{"role": "user", "content": EXTRACT}],
            max_retries=0,
            temperature=0,
            max_tokens=4,
        )


def test_instructor_streams_partial_objects(openai_sync):
    """`create_partial`: the forced call's arguments streamed, parsed as they grow."""
    client = instructor.from_openai(openai_sync)
    partials = list(
        client.chat.completions.create_partial(
            model=MODEL,
            response_model=Person,
            messages=[{"role": "user", "content": EXTRACT}],
            max_retries=0,
            temperature=0,
            max_tokens=64,
        )
    )
    assert len(partials) > 2
    assert Person.model_validate(partials[-1].model_dump()) == Person(name="Alice", age=30)


def test_the_server_is_idle_after_the_frameworks(url):
    assert wait_idle(url)["lmengine_kv_blocks_used"] == 0
