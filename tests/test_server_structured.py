"""Structured outputs over HTTP, with the official `openai` client: `response_format` (a
pydantic model through `chat.completions.parse`, and json_object), vLLM's `guided_*` fields and
`structured_outputs` object in chat and completions, streamed too; bad constraints are 400
with xgrammar's message and the server goes on."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server import TINY_OPENAI_FLAGS, openai_client, tiny_server, wait_idle


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int
    toys: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with tiny_server(tiny_llama_path, *TINY_OPENAI_FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_parse_with_a_pydantic_model(client):
    for seed in range(4):
        completion = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            max_completion_tokens=200,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Pet)


def test_json_object_guided_fields_and_structured_outputs_object(client):
    def chat(**kwargs):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Answer."}],
            max_tokens=120,
            **kwargs,
        )
        return r.choices[0].message.content

    text = chat(response_format={"type": "json_object"}, temperature=0)
    assert text.startswith("{")  # the tiny model may run out of tokens inside the object
    assert chat(extra_body={"guided_choice": ["left", "right"]}) in ("left", "right")
    assert re.fullmatch(r"\d{2}:\d{2}", chat(extra_body={"guided_regex": r"\d{2}:\d{2}"}))
    grammar = 'root ::= "go " ("north" | "south")'
    assert chat(extra_body={"structured_outputs": {"grammar": grammar}}) in ("go north", "go south")
    number = {"type": "regex", "pattern": "[0-9]{2}"}
    tag = {  # the tag, then the end
        "type": "structural_tag",
        "format": {"type": "tag", "begin": "<n>", "content": number, "end": "</n>"},
    }
    assert re.fullmatch(
        r"<n>\d{2}</n>", chat(extra_body={"structured_outputs": {"structural_tag": tag}})
    )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    completion = client.completions.create(
        model="tiny", prompt="n =", max_tokens=60, extra_body={"guided_json": schema}
    )
    assert isinstance(json.loads(completion.choices[0].text)["n"], int)


def test_streamed_constrained_output(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Time?"}],
        max_tokens=40,
        stream=True,
        extra_body={"guided_regex": r"[0-2]\d:[0-5]\d(:[0-5]\d)?"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"[0-2]\d:[0-5]\d(:[0-5]\d)?", text)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"guided_json": {"type": "objectx"}}, 'Unsupported type "objectx"'),
        ({"guided_regex": "(ab"}, "The parenthesis is not closed"),
        ({"guided_grammar": "root ::= "}, "EBNF parser error"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give one output constraint"),
        ({"structured_outputs": {}}, "exactly one of"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ],
)
def test_bad_constraints_are_400(client, server, extra, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
    assert message in str(err.value)
    assert wait_idle(server)["lmengine_kv_blocks_used"] == 0
    ok = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert ok.choices[0].finish_reason == "length"
