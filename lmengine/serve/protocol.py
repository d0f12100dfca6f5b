"""Request bodies of the HTTP API (pydantic), OpenAI's field names and ranges.

Fields OpenAI defines keep its names, defaults and ranges; our extensions (`top_k`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `priority`, `user_id`, ...) follow vLLM's
names. Unknown fields are ignored, as OpenAI clients send many. Ranges are declared here so
that the OpenAPI document states them and a bad value is a 400 before the engine sees it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

MAX_CHOICES = 64  # n (x prompts) per request
MAX_STOP_WORDS = 16


# NOTE: the OpenAPI document states the served vocabulary as the bound (x-token-id)
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1, json_schema_extra={"x-token-id": True})]
NonEmpty = Annotated[str, Field(min_length=1)]
StopStrings = str | Annotated[list[str], Field(max_length=MAX_STOP_WORDS)] | None
Choices = Annotated[list[NonEmpty], Field(min_length=1)]


def integral_floats_as_ints(value):
    """JSON Schema counts 2.0 as an integer: the body with such floats as ints (the models
    are strict otherwise: no "2" for 2, no true for 1)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral_floats_as_ints(v) for v in value]
    return value


def lone_surrogate(value, path: str = "") -> str | None:
    """Where in a JSON value a string holds a lone UTF-16 surrogate (JSON can escape one,
    \\ud800, but it is no Unicode text): "path (U+D800)", or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{path or 'the body'} (U+{ord(value[e.start]):04X})"
        return None
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = lone_surrogate(key, path) if isinstance(key, str) else None
        where = where or lone_surrogate(item, f"{path}.{key}" if path else str(key))
        if where is not None:
            return where
    return None


class _Body(BaseModel):
    """A request body: text in it must be Unicode (checked before the fields)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data):
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where}: a lone surrogate is not valid Unicode text")
        return integral_floats_as_ints(data)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False  # a last chunk with `usage` and no choices


def at_most_one(fields: dict[str, dict], exactly: bool = False) -> dict:
    """JSON Schema for "at most (or exactly) one of `fields` is given": `fields` maps each
    name to the schema its value matches when it counts as given (null never counts)."""

    def given(name: str) -> dict:
        return {"required": [name], "properties": {name: fields[name]}}

    alternatives = [given(name) for name in fields]
    if not exactly:  # none given
        alternatives.append({"not": {"anyOf": alternatives[:]}})
    return {"oneOf": alternatives}


NOT_NULL = {"not": {"type": "null"}}
# NOTE: above 2**53 a JSON number may be a float that rounds past the bound
SAFE_INT = 2**53 - 1


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra=at_most_one(
            dict.fromkeys(("json", "json_object", "regex", "choice", "grammar",
                           "structural_tag"), NOT_NULL), exactly=True),
    )  # fmt: skip
    json_: dict | str | None = Field(None, alias="json")
    json_object: Literal[True] | None = None
    regex: NonEmpty | None = None
    choice: Choices | None = None
    grammar: NonEmpty | None = None
    structural_tag: Annotated[dict, Field(min_length=1)] | NonEmpty | None = None  # xgrammar


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str | None = None
    schema_: dict = Field(..., alias="schema")
    strict: bool | None = None


class _Format(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextFormat(_Format):
    type: Literal["text"]


class JSONObjectFormat(_Format):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


# OpenAI's `response_format`: text, any JSON object, or a JSON schema
ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")  # fmt: skip
NULL = {"type": "null"}


def request_rules(endpoint: str) -> dict:
    """What a completions or chat request's fields ask of each other, as JSON Schema, so
    that the OpenAPI document refuses what the server refuses:
    - one output constraint at most (`response_format` text is none);
    - beam search (`num_beams` > 1) with one choice, without stop strings, logprobs, prompt
      logprobs, output constraints or `max_tokens=0`;
    - no output constraint with `ignore_eos` or `min_tokens` (the output ends with it);
    - chat: `tool_choice` "required" or a named function needs tools, and neither beams
      nor another constraint."""
    one_constraint = at_most_one({
        "response_format": {"properties": {"type": {"enum": ["json_object", "json_schema"]}},
                            "required": ["type"]},
        **dict.fromkeys(CONSTRAINTS, NOT_NULL),
    })  # fmt: skip
    beams = {
        "n": {"maximum": 1},
        "stop": {"anyOf": [NULL, {"const": ""}, {"type": "array", "items": {"const": ""}}]},
        "prompt_logprobs": NULL,
        "max_tokens": {"anyOf": [NULL, {"minimum": 1}]},
        "response_format": {"anyOf": [NULL, {"properties": {"type": {"const": "text"}}}]},
        **dict.fromkeys(CONSTRAINTS, NULL),
    }
    forcing = {"not": {"enum": ["none", "auto", None]}}  # "required" or a named function
    forces_a_call = {"required": ["tool_choice"], "properties": {"tool_choice": forcing}}
    unconstrained = {
        "response_format": beams["response_format"],
        **dict.fromkeys(CONSTRAINTS, NULL),
    }
    rules = []
    if endpoint == "completions":
        beams["logprobs"] = NULL
    else:  # a forced call is a constraint: tools, and no beams, no other constraint
        beams["logprobs"] = {"anyOf": [NULL, {"const": False}]}
        some_tools = {"tools": {"type": "array", "minItems": 1}}
        forced = {**unconstrained, **some_tools, "num_beams": {"maximum": 1}}
        rules.append({"if": forces_a_call, "then": {"required": ["tools"], "properties": forced}})
    for field, value in (("ignore_eos", {"const": True}), ("min_tokens", {"minimum": 1})):
        asks = {"required": [field], "properties": {field: value}}
        rules.append({"if": asks, "then": {"properties": unconstrained}})
        if endpoint == "chat":
            rules.append({"if": asks, "then": {"not": forces_a_call}})
    is_beam = {"required": ["num_beams"], "properties": {"num_beams": {"minimum": 2}}}
    rules.append({"if": is_beam, "then": {"properties": beams}})
    return {**one_constraint, "allOf": rules}


class _SamplingFields(_Body):
    """What completions and chat completions share."""

    model: str | None = None  # the served model or an adapter name; None: the base model
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: StopStrings = None
    seed: int | None = Field(None, ge=0, le=SAFE_INT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = Field(None, max_length=256)
    # extensions
    top_k: int = Field(0, ge=-1)  # 0 or -1: no top-k filter
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    skip_special_tokens: bool = True
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    user_id: str | None = Field(None, max_length=256)  # the QoS user; default: `user`
    # vLLM's prompt scoring: per prompt token its logprob and the top N (`prompt_logprobs`)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # constrained output (docs/structured_outputs.md): OpenAI's response_format, vLLM's
    # guided_* fields and its structured_outputs object; at most one of them
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonEmpty | None = None
    structured_outputs: StructuredOutputs | None = None
    # beam search (n must be 1; the choice is the best beam; temperature is not used)
    num_beams: int = Field(1, ge=1, le=MAX_CHOICES)
    length_penalty: float = Field(1.0, ge=-20.0, le=20.0)
    early_stopping: bool | Literal["never"] = False


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: raw prompts, no chat template."""

    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra=request_rules("completions")
    )

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # OpenAI's default for completions; 0 with `echo` scores the prompt only
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Literal[1] | None = None  # more candidates than choices: not supported


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = str | list[TextPart]


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str | None = None

    @field_validator("role", check_fields=False)
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role  # OpenAI's newer name


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    """A system message under OpenAI's newer name (its role reads "system" once parsed)."""

    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    """An earlier answer: text, tool calls, or both (neither reads as empty text)."""

    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallMessage] | None = None


class ToolMessage(_Message):
    """A tool's result, answering the call `tool_call_id`."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str


MESSAGE_TYPES = {
    "system": SystemMessage,
    "developer": DeveloperMessage,
    "user": UserMessage,
    "assistant": AssistantMessage,
    "tool": ToolMessage,
}
# NOTE: a union's tag shows in the location of an error inside it; every tag holds a space
# ("user message"), so that no field name is one, and the error answer leaves it out
# (messages.0.content)


def _message_kind(message) -> str | None:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return f"{role} message" if isinstance(role, str) and role in MESSAGE_TYPES else None


# one message of a conversation, by role (OpenAI's message types)
ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("system message")]
    | Annotated[DeveloperMessage, Tag("developer message")]
    | Annotated[UserMessage, Tag("user message")]
    | Annotated[AssistantMessage, Tag("assistant message")]
    | Annotated[ToolMessage, Tag("tool message")],
    Discriminator(
        _message_kind,
        custom_error_type="role",
        custom_error_message="a message is an object whose role is one of "
        + ", ".join(MESSAGE_TYPES),
    ),
]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: messages through the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=request_rules("chat"))

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # tool calling (docs/structured_outputs.md#tool-calling)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizePromptRequest(_Body):
    """POST /tokenize (vLLM) with a prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """POST /tokenize (vLLM) with chat messages, through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


def _tokenize_kind(body) -> str | None:
    """Which of /tokenize's two bodies `body` is (its tag), or None for both or neither
    (refused with one message instead of each model's errors)."""
    if isinstance(body, BaseModel):
        return "messages body" if isinstance(body, TokenizeChatRequest) else "prompt body"
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        return None
    return "prompt body" if "prompt" in body else "messages body"


# a prompt or messages, not both (vLLM's two request types)
TokenizeRequest = Annotated[
    Annotated[TokenizePromptRequest, Tag("prompt body")]
    | Annotated[TokenizeChatRequest, Tag("messages body")],
    Discriminator(
        _tokenize_kind,
        custom_error_type="prompt_or_messages",
        custom_error_message="give exactly one of prompt or messages",
    ),
]


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM): token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


class CompletionRequestQos(CompletionRequest):
    """POST /v1/completions_qos (LMDeploy): a completion on behalf of a QoS user."""


class ChatCompletionRequestQos(ChatCompletionRequest):
    """POST /v1/chat/completions_qos (LMDeploy): a chat completion for a QoS user."""


class InteractiveRequestQos(_Body):
    """POST /v1/chat/interactive_qos (LMDeploy): one turn of a chat session kept by the
    server under `session_id`; `interactive_mode=False` ends the session after this turn."""

    # this turn's user text, or messages to append
    prompt: str | Annotated[list[ChatMessage], Field(min_length=1)]
    session_id: int = Field(-1, ge=-1, le=SAFE_INT)  # -1: a one-off turn without history
    interactive_mode: bool = False
    cancel: bool = False  # stop the session's running turn and end the session
    stream: bool = False
    request_output_len: int = Field(512, ge=1)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_p: float = Field(0.8, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=-1)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, le=SAFE_INT)
    stop: StopStrings = None
    user_id: str | None = Field(None, max_length=256)
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM): serve the peft LoRA folder `lora_path` as the model
    `lora_name`."""

    lora_name: str = Field(..., min_length=1, max_length=256)
    lora_path: str = Field(..., min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM): stop serving `lora_name` (running requests
    finish with it)."""

    lora_name: str = Field(..., min_length=1, max_length=256)
