"""Request bodies of the HTTP API (pydantic), OpenAI's field names and ranges.

Fields OpenAI defines keep its names, defaults and ranges; our extensions (`top_k`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `priority`, `user_id`, ...) follow vLLM's
names. Unknown fields are ignored, as OpenAI clients send many. Ranges are declared here so
that the OpenAPI document states them and a bad value is a 400 before the engine sees it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 64  # n (x prompts) per request
MAX_STOP_WORDS = 16
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's message roles


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
        items = value.items()
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

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data):
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where}: a lone surrogate is not valid Unicode text")
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last chunk with `usage` and no choices


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None  # xgrammar's structural tag


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(_Body):
    """What completions and chat completions share."""

    model: str | None = None  # the served model or an adapter name; None: the base model
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
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
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # beam search (n must be 1; the choice is the best beam; temperature is not used)
    num_beams: int = Field(1, ge=1, le=MAX_CHOICES)
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)
    early_stopping: bool | Literal["never"] = False


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: raw prompts, no chat template."""

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
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # only best_of == n is accepted


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message; `content` may be left out only by an assistant message with tool calls.
    A `developer` message is a system message (OpenAI's newer name)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: messages through the chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # tool calling (docs/structured_outputs.md#tool-calling)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM): a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM): token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId]


class CompletionRequestQos(CompletionRequest):
    """POST /v1/completions_qos (LMDeploy): a completion on behalf of a QoS user."""


class ChatCompletionRequestQos(ChatCompletionRequest):
    """POST /v1/chat/completions_qos (LMDeploy): a chat completion for a QoS user."""


class InteractiveRequestQos(_Body):
    """POST /v1/chat/interactive_qos (LMDeploy): one turn of a chat session kept by the
    server under `session_id`; `interactive_mode=False` ends the session after this turn."""

    prompt: str | list[ChatMessage]  # this turn's user text, or messages to append
    session_id: int = Field(-1, ge=-1, le=2**62)  # -1: a one-off turn without history
    interactive_mode: bool = False
    cancel: bool = False  # stop the session's running turn and end the session
    stream: bool = False
    request_output_len: int = Field(512, ge=1)
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    top_p: float = Field(0.8, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=-1)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    user_id: str | None = Field(None, max_length=256)
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
