"""POST /v1/responses (OpenAI's Responses API) with the official `openai` client and the
OpenAI Agents SDK: text whole and streamed (the deltas join to the whole text, the events
in the SDK's order), function tools under `tool_choice` (constrained: the tiny random model's
calls always parse), `text.format` with a JSON schema, function call items and their outputs
as input, stored responses and `previous_response_id`, bad requests; and an Agents SDK agent
with a function tool over SmolLM2."""

from __future__ import annotations

import openai
import pytest

from tests.test_server import API_KEY, TINY_OPENAI_FLAGS, openai_client, tiny_server, wait_idle
from tests.test_server_tools import Weather

try:  # the HTTP client the installed openai package uses
    import httpx2 as httpx
except ImportError:
    import httpx


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": Weather.model_json_schema(),
}
EARLIER_EXCHANGE = [  # an agent session's items: a question, the call, its output, the answer
    {"role": "user", "content": "What's the weather in Berlin?"},
    {"type": "function_call", "call_id": "call_0", "name": "get_weather",
     "arguments": '{"city": "Berlin"}'},
    {"type": "function_call_output", "call_id": "call_0",
     "output": "It is 12 degrees and cloudy in Berlin."},
    {"role": "assistant", "content": "It is 12 degrees and cloudy in Berlin."},
]  # fmt: skip
GREEDY = dict(temperature=0, max_output_tokens=24)


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with tiny_server(tiny_llama_path, *TINY_OPENAI_FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_text_whole_and_streamed_are_the_same(client):
    whole = client.responses.create(model="tiny", input="Say hello", **GREEDY)
    assert whole.object == "response" and whole.id.startswith("resp_")
    (item,) = whole.output
    assert item.type == "message" and item.role == "assistant"
    assert whole.output_text and whole.status == "incomplete"  # 24 tokens, no end
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 24 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + 24

    events = list(client.responses.create(model="tiny", input="Say hello", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    last = events[-1].response
    assert last.output_text == whole.output_text and last.usage.output_tokens == 24


def test_instructions_and_message_items_reach_the_template(client):
    """The same conversation as a string and as message items with text parts is the same
    prompt; `instructions` is its system message, as chat completions reads it."""
    short = client.responses.create(model="tiny", input="Hi", **GREEDY)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    same = client.responses.create(model="tiny", input=items, **GREEDY)
    assert same.output_text == short.output_text
    assert same.usage.input_tokens == short.usage.input_tokens
    told = client.responses.create(model="tiny", input="Hi", instructions="Be brief.", **GREEDY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=24,
    )
    assert told.usage.input_tokens == chat.usage.prompt_tokens
    assert told.output_text == chat.choices[0].message.content
    assert told.instructions == "Be brief."


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_that_parse(client, parallel):
    for seed in range(3):
        r = client.responses.create(
            model="tiny",
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_output_tokens=300,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        calls = [item for item in r.output if item.type == "function_call"]
        assert calls and (parallel or len(calls) == 1), (r.status, r.output)
        for call in calls:
            assert call.name == "get_weather" and call.call_id.startswith("call_")
            Weather.model_validate_json(call.arguments)


def test_streamed_call_arguments_join_to_the_call(client):
    args = dict(model="tiny", input="Weather in Rome?", tools=[WEATHER], max_output_tokens=200,
                tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    events = list(client.responses.create(**args, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(pieces) == done.arguments and len(pieces) > 3
    Weather.model_validate_json(done.arguments)
    final = events[-1].response
    assert [i.arguments for i in final.output if i.type == "function_call"] == [done.arguments]


def test_json_schema_text_format_validates(client):
    r = client.responses.create(
        model="tiny",
        input="Describe the weather.",
        text={
            "format": {
                "type": "json_schema",
                "name": "weather",
                "schema": Weather.model_json_schema(),
                "strict": True,
            }
        },  # fmt: skip
        max_output_tokens=120,
    )
    Weather.model_validate_json(r.output_text)
    parsed = client.responses.parse(
        model="tiny", input="Describe the weather.", text_format=Weather, max_output_tokens=120
    )
    assert isinstance(parsed.output_parsed, Weather)


def test_a_call_and_its_output_as_input_then_previous_response_id(client):
    """An agent's turn: the call the model made and the tool's output go back as items; the
    answer is stored, continued by `previous_response_id` and read back by GET."""
    first = client.responses.create(
        model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=200,
    )  # fmt: skip
    (call,) = [i for i in first.output if i.type == "function_call"][:1]
    turn = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 3}'},
    ]  # fmt: skip
    answer = client.responses.create(model="tiny", input=turn, tools=[WEATHER], **GREEDY)
    assert answer.output_text and answer.usage.input_tokens > first.usage.input_tokens
    follow = client.responses.create(
        model="tiny", input="And tomorrow?", previous_response_id=answer.id, **GREEDY
    )
    assert follow.previous_response_id == answer.id
    history = [  # the same conversation as chat messages: the same prompt
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 3}'},
        {"role": "assistant", "content": answer.output_text},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    chat = client.chat.completions.create(model="tiny", messages=history, max_tokens=1)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(answer.id).output_text == answer.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    unstored = client.responses.create(model="tiny", input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="Hi", previous_response_id=unstored.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "model": "nope"}, None),
    ],
)
def test_bad_requests_are_refused(server, body, param):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server + "/v1/responses", json=body, headers=auth)
    assert r.status_code == (404 if body.get("model") else 400), r.text
    error = r.json()["error"]
    assert param is None or (error["param"] or "").startswith(param), error
    assert wait_idle(server)["lmengine_kv_blocks_used"] == 0


def test_agents_sdk_runs_an_agent_with_a_function_tool(smollm2_path):
    """The OpenAI Agents SDK as its users write it: an Agent with a function tool, run by
    `Runner.run_sync` over the Responses API, with the session's earlier items. SmolLM2 calls
    the tool for the city of the question, reads its result and answers in text."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no network: no trace export
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        asked.append(city)
        return f"It is 21 degrees and sunny in {city}."

    with tiny_server(smollm2_path, "--api-keys", API_KEY, "--num-gpu-blocks", "512") as url:
        model = OpenAIResponsesModel(
            model="SmolLM2-135M-Instruct",
            openai_client=openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0),
        )
        settings = ModelSettings(temperature=0, max_tokens=64)
        agent = Agent(name="Assistant", instructions="You are a helpful assistant.",
                      model=model, tools=[get_weather], model_settings=settings)  # fmt: skip
        # the session so far: one earlier exchange with the tool (a 135M model follows it)
        question = {"role": "user", "content": "What's the weather in Tokyo?"}
        result = Runner.run_sync(agent, [*EARLIER_EXCHANGE, question], max_turns=3)
        assert asked == ["Tokyo"]
        kinds = [item.type for item in result.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
        assert "Tokyo" in result.final_output
        assert wait_idle(url)["lmengine_kv_blocks_used"] == 0
