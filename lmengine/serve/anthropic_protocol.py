"""Request bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages
API), with Anthropic's field names and ranges.

A conversation is `system` (text) and `messages` of role user or assistant, each a text or
content blocks: `text`, the assistant's `tool_use` (an object `input`), the user's
`tool_result` (a text or text blocks). The served models read text only: image and document
blocks are refused (a 400 saying so), as are server tools (a `type` other than "custom").
`thinking` is ignored (the answer holds no thinking blocks; earlier thinking blocks in the
history are dropped), as is every other field this module does not name. Ranges are
declared here, so the OpenAPI document states them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from lmengine.serve.protocol import MAX_STOP_WORDS, _Body

MAX_MESSAGES = 4096
MAX_TOOLS = 128
# NOTE: a union's tag shows in the location of an error inside it; each holds a space, so no
# field name is one, and the error answer leaves them out (messages.0.content.1.text)


def _tag_of(tags: dict[str, str]):
    """A callable discriminator: the tag of the value's `type` in `tags` (None: unknown)."""

    def tag(value) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    return tag


def _text_or_blocks(prefix: str):
    """A discriminator of "a text or a list of blocks" (so an error names one of the two)."""

    def tag(value) -> str | None:
        if isinstance(value, str):
            return f"{prefix} text"
        return f"{prefix} blocks" if isinstance(value, list) else None

    return tag


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """A call the model made earlier: the tool's `name` and its `input` object."""

    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., min_length=1, max_length=64)
    input: dict


class ThinkingBlock(_Block):
    """An earlier answer's thinking, handed back by a client: dropped (none is produced)."""

    type: Literal["thinking", "redacted_thinking"]


TEXT_ONLY = "image and document blocks are refused: the served model reads text only"
TextBlocks = list[TextBlock]
ResultContent = Annotated[
    Annotated[str, Tag("result text")] | Annotated[TextBlocks, Tag("result blocks")],
    Discriminator(
        _text_or_blocks("result"),
        custom_error_type="content",
        custom_error_message="a tool result's content is a text or a list of text blocks",
    ),
]


class ToolResultBlock(_Block):
    """The result of the call `tool_use_id`, as the application ran it (`is_error`: it
    failed; the model reads the content after "Error: ")."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=256)
    content: ResultContent = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in ("image", "document") for b in content
        ):
            raise ValueError(f"a tool result's content is text: {TEXT_ONLY}")
        return content


UserBlock = Annotated[
    Annotated[TextBlock, Tag("text block")] | Annotated[ToolResultBlock, Tag("tool_result block")],
    Discriminator(
        _tag_of({"text": "text block", "tool_result": "tool_result block"}),
        custom_error_type="block_type",
        custom_error_message=f"a user content block is of type text or tool_result ({TEXT_ONLY})",
    ),
]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("text block")]
    | Annotated[ToolUseBlock, Tag("tool_use block")]
    | Annotated[ThinkingBlock, Tag("thinking block")],
    Discriminator(
        _tag_of(
            {
                "text": "text block",
                "tool_use": "tool_use block",
                "thinking": "thinking block",
                "redacted_thinking": "thinking block",
            }
        ),  # fmt: skip
        custom_error_type="block_type",
        custom_error_message="an assistant content block is of type text, tool_use, thinking "
        f"or redacted_thinking ({TEXT_ONLY})",
    ),
]


def _content(block):
    return Annotated[
        Annotated[str, Tag("content text")] | Annotated[list[block], Tag("content blocks")],
        Discriminator(
            _text_or_blocks("content"),
            custom_error_type="content",
            custom_error_message="a message's content is a text or a list of content blocks",
        ),
    ]


class UserMessage(_Block):
    role: Literal["user"]
    content: _content(UserBlock)  # type: ignore[valid-type]


class AssistantMessage(_Block):
    """An earlier answer (text and tool calls)."""

    role: Literal["assistant"]
    content: _content(AssistantBlock)  # type: ignore[valid-type]


def _role_of(message) -> str | None:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return f"{role} message" if role in ("user", "assistant") else None


Message = Annotated[
    Annotated[UserMessage, Tag("user message")]
    | Annotated[AssistantMessage, Tag("assistant message")],
    Discriminator(
        _role_of,
        custom_error_type="role",
        custom_error_message="a message is an object whose role is user or assistant (the "
        "system prompt is the `system` field)",
    ),
]
SystemPrompt = Annotated[
    Annotated[str, Tag("system text")] | Annotated[TextBlocks, Tag("system blocks")],
    Discriminator(
        _text_or_blocks("system"),
        custom_error_type="content",
        custom_error_message="`system` is a text or a list of text blocks",
    ),
]


class CustomTool(_Block):
    """A tool the application runs: its name, description and input's JSON schema (server
    tools, whose `type` names a tool Anthropic runs, are refused)."""

    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict

    @field_validator("type", mode="before")
    @classmethod
    def _custom_only(cls, kind):
        if kind not in (None, "custom"):
            raise ValueError(
                f"server tools (type {kind!r}) are not supported: give tools the application "
                "runs (a name, a description and an input_schema)"
            )
        return kind


class _Choice(_Block):
    disable_parallel_tool_use: bool = False  # at most one call


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    """At least one call, of any tool (constrained to the tools' schemas)."""

    type: Literal["any"]


class ToolChoice(_Choice):
    """A call of the tool `name` (constrained to its schema)."""

    type: Literal["tool"]
    name: str


class NoneChoice(_Block):
    type: Literal["none"]


AnthropicToolChoice = Annotated[
    Annotated[AutoChoice, Tag("auto choice")]
    | Annotated[AnyChoice, Tag("any choice")]
    | Annotated[ToolChoice, Tag("tool choice")]
    | Annotated[NoneChoice, Tag("none choice")],
    Discriminator(
        _tag_of({kind: f"{kind} choice" for kind in ("auto", "any", "tool", "none")}),
        custom_error_type="tool_choice",
        custom_error_message="tool_choice is an object of type auto, any, tool or none",
    ),
]
# a call that must be made needs a tool to call (NOTE: "type": "object", else a null
# tool_choice, which forces nothing, would meet `required` and `properties` vacuously)
NEEDS_TOOLS: dict = {
    "if": {
        "required": ["tool_choice"],
        "properties": {"tool_choice": {"type": "object", "required": ["type"],
                                       "properties": {"type": {"enum": ["any", "tool"]}}}},
    },
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}  # fmt: skip


class Metadata(_Block):
    user_id: str | None = Field(None, max_length=256)  # the QoS user


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: the prompt a Messages request would make, counted."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=NEEDS_TOOLS)

    # the served model or an adapter name (Anthropic requires it; here none is the base model)
    model: str | None = None
    messages: list[Message] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: SystemPrompt | None = None
    tools: list[CustomTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages: the model's next message, whole or as Anthropic's events."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=NEEDS_TOOLS)

    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_WORDS)
    temperature: float = Field(1.0, ge=0.0, le=1.0)  # 0: greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # 0 or none: no top-k filter
    stream: bool = False
    metadata: Metadata | None = None


class TokenCount(BaseModel):
    """The answer of count_tokens."""

    input_tokens: int
