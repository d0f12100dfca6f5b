"""Request body of POST /v1/responses (OpenAI's Responses API), with OpenAI's field names.

`input` is a text or a list of items: messages (text parts), the model's earlier
`function_call`s and their `function_call_output`s (and `reasoning` items, which a text
model has none of: they are dropped). Tools are function tools; `text.format` is the output
constraint. Ranges are declared here, so the OpenAPI document states them; the extensions
(`top_k`, `repetition_penalty`, `seed`, `stop`, `priority`, `user_id`) keep vLLM's names.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from lmengine.serve.protocol import (
    NULL,
    SAFE_INT,
    JSONObjectFormat,
    StopStrings,
    TextFormat,
    _Body,
)

MAX_ITEMS = 4096  # input items per request
ITEM_TAGS = ("message", "function_call", "function_call_output", "reasoning")


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputText(_Item):
    """A text part: the user's (`input_text`) or the model's own earlier output
    (`output_text`, as a previous response's message item carries it)."""

    type: Literal["input_text", "output_text"]
    text: str


class Refusal(_Item):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | Refusal, Field(discriminator="type")]


class MessageItem(_Item):
    """A message: `role` and its text, as a string or parts ("developer" reads "system")."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Item):
    """A call the model made earlier (from a previous response's output)."""

    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str  # JSON text


class FunctionCallOutputItem(_Item):
    """The result of the call `call_id`, as the application ran it."""

    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[InputText]


class ReasoningItem(_Item):
    """A reasoning item handed back by a client (a text model has nothing to say to it)."""

    type: Literal["reasoning"]


def _item_kind(item) -> str | None:
    """The tag of an input item: "<its type> item", "message item" when it has only a role
    (tags hold a space: the error answer leaves them out of a location)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return f"{kind} item" if kind in ITEM_TAGS else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message item")]
    | Annotated[FunctionCallItem, Tag("function_call item")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output item")]
    | Annotated[ReasoningItem, Tag("reasoning item")],
    Discriminator(
        _item_kind,
        custom_error_type="item_type",
        custom_error_message="an input item is a message or one of type " + ", ".join(ITEM_TAGS),
    ),
]


# at least one item that is not a reasoning item (a request of reasoning items alone is
# refused, unless a previous response gives the conversation)
NOT_REASONING = {"not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}


def _input_kind(value) -> str | None:
    if isinstance(value, str):
        return "text input"
    return "item list" if isinstance(value, list) else None


class FunctionTool(_Item):
    """A function tool, flat (the Responses API's shape, not chat's nested `function`)."""

    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class NamedFunctionChoice(_Item):
    type: Literal["function"]
    name: str


class JSONSchemaTextFormat(_Item):
    """`text.format` with a JSON schema, flat (name, schema, strict beside the type)."""

    type: Literal["json_schema"]
    name: str | None = None
    schema_: dict = Field(..., alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Item):
    format: Annotated[
        TextFormat | JSONObjectFormat | JSONSchemaTextFormat, Field(discriminator="type")
    ] = TextFormat(type="text")


def _rules() -> dict:
    """What the fields ask of each other, as JSON Schema (the server refuses the same): a
    `tool_choice` that forces a call ("required" or a named function) needs tools and
    takes no `text.format` constraint besides text."""
    forcing = {"not": {"enum": ["none", "auto", None]}}
    forces = {"required": ["tool_choice"], "properties": {"tool_choice": forcing}}
    text_only = {"properties": {"format": {"properties": {"type": {"const": "text"}}}}}
    needs = {"tools": {"type": "array", "minItems": 1}, "text": {"anyOf": [NULL, text_only]}}
    return {"allOf": [{"if": forces, "then": {"required": ["tools"], "properties": needs}}]}


class ResponsesRequest(_Body):
    """POST /v1/responses: one answer to `input`, whole or as typed events."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_rules())

    model: str | None = None  # the served model or an adapter name
    input: Annotated[
        Annotated[str, Tag("text input")]
        | Annotated[
            list[InputItem],
            Field(
                min_length=1, max_length=MAX_ITEMS, json_schema_extra={"contains": NOT_REASONING}
            ),
            Tag("item list"),
        ],  # fmt: skip
        Discriminator(
            _input_kind,
            custom_error_type="input",
            custom_error_message="input is a text or a list of items",
        ),
    ]
    instructions: str | None = None  # a system message first (not kept across responses)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    stream: bool = False
    store: bool = True  # kept in memory (bounded) for previous_response_id and GET
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    truncation: Literal["disabled", "auto"] | None = None  # a prompt too long is a 400
    background: Literal[False] | None = None  # no background responses
    # extensions (vLLM's names)
    stop: StopStrings = None
    seed: int | None = Field(None, ge=0, le=SAFE_INT)
    top_k: int = Field(0, ge=-1)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    user_id: str | None = Field(None, max_length=256)  # the QoS user; default: `user`
