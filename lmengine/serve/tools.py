"""Tool calling for chat completions: the tools into the prompt, the constraint that
`tool_choice` implies, and the model's text back into OpenAI's `tool_calls`.

- `tool_choice="auto"`: the tools go into the prompt (through the chat template when it takes
  `tools`, else as a system message in the Hermes style most instruct models were trained on),
  generation is free, and a parser of the model family finds the calls in the text.
- `"required"`: the output is constrained to a JSON array of calls `[{"name", "arguments"}]`
  over the given functions (one call when `parallel_tool_calls` is false), so it always parses.
- a named function: the output is constrained to that function's parameters schema; it is the
  call's `arguments`.
- `"none"`: the tools are left out; plain text.

Parsers are registered by name (`TOOL_PARSERS`, the server's `--tool-call-parser`): `hermes`
(`<tool_call>{...}</tool_call>` blocks of Qwen 2.5/3 and Hermes; a JSON list inside one block,
as SmolLM2 writes, works too) and `llama3_json` (Llama 3.x: `{"name": ..., "parameters": ...}`
objects, optionally after `<|python_tag|>`, separated by `;`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from lmengine.serve.convert import text_of
from lmengine.serve.errors import APIError


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict:
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call_of(obj, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (or a JSON list of
    calls in one block); the text outside the blocks is the content."""

    start = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                continue
            for item in obj if isinstance(obj, list) else [obj]:
                call = _call_of(item)
                if call is not None:
                    calls.append(call)
        if not calls:
            return text, []
        content = self._BLOCK.sub("", text).strip()
        return content or None, calls


class Llama3JsonParser:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`; anything else is content."""

    start = "{"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return None, calls


TOOL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_choice_mode(body) -> tuple[str, str | None]:
    """(mode, function name): mode is "none", "auto", "required" or "named"."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return "none", None
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    name = choice.function.name
    if name not in {t.function.name for t in body.tools}:
        raise APIError(400, f"tool_choice names an unknown function {name!r}", param="tool_choice")
    return "named", name


def tool_constraint(body, mode: str, name: str | None) -> dict | None:
    """The structured_outputs spec that `required` or a named function implies."""
    functions = {t.function.name: t.function for t in body.tools or []}
    if mode == "named":
        return {"json": functions[name].parameters or {"type": "object"}}
    if mode != "required":
        return None
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f.name},
                    "arguments": f.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for f in functions.values()
        ]
    }
    schema = {"type": "array", "items": call, "minItems": 1}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return {"json": schema}


def calls_from_constrained(text: str, mode: str, name: str | None) -> list[ToolCall]:
    """The calls of a `required` or named-function output (JSON the grammar produced)."""
    if mode == "named":
        return [ToolCall(name, text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:  # cut by max_tokens: no complete call
        return []
    return [c for c in (_call_of(item) for item in items) if c is not None]


def template_takes_tools(tokenizer, template: str | None) -> bool:
    source = template or getattr(tokenizer, "chat_template", None) or ""
    return isinstance(source, str) and "tools" in source


def tools_system_prompt(tools: list[dict]) -> str:
    """Tool definitions as a system message, for chat templates that do not take `tools`: the
    Hermes-style layout (definitions in <tools>, calls as a JSON list in <tool_call>) that
    instruct models such as SmolLM2 were trained on."""
    listed = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You are an expert in calling functions. Given a question and the functions below, "
        "decide whether one or more function calls answer it.\n\n"
        f"You have access to the following tools:\n<tools>{listed}</tools>\n\n"
        "To call functions, reply with nothing but the calls in this format:\n"
        '<tool_call>[{"name": "function_name", "arguments": {"parameter": "value"}}]'
        "</tool_call>\nIf no function fits the question, answer it in plain text."
    )


def _calls_of_message(message) -> list[dict]:
    """An assistant message's `tool_calls` as {"name", "arguments": object}."""
    calls = []
    for c in message.tool_calls:
        try:
            args = json.loads(c.function.arguments)
        except json.JSONDecodeError:
            raise APIError(
                400, "a tool call's arguments in the history are not JSON", param="messages"
            ) from None
        calls.append({"name": c.function.name, "arguments": args})
    return calls


def chat_messages(messages, native_tools: bool) -> list[dict]:
    """The request's messages for the chat template. With a template that takes tools, the
    assistant's `tool_calls` stay structured (arguments as objects); otherwise tool calls are
    written as the Hermes-style text the tools system prompt asks for."""
    out = []
    for m in messages:
        message = {"role": m.role, "content": text_of(m)}
        if m.role == "assistant" and m.tool_calls:
            calls = _calls_of_message(m)
            if native_tools:
                message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            else:
                text = f"<tool_call>{json.dumps(calls)}</tool_call>"
                message["content"] = f"{message['content']}\n{text}".strip()
        if m.role == "tool" and m.tool_call_id is not None and native_tools:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


class ToolOutput:
    """One choice's text turned into content and tool calls, whole (`final`) or step by step
    (`delta`): under `auto`, content streams until the parser's start marker may begin and
    the calls follow complete when the choice ends; a named function's arguments stream as
    they come; `required` calls come complete at the end."""

    def __init__(self, mode: str, name: str | None, parser_name: str) -> None:
        self.mode, self.name = mode, name
        self.parser = TOOL_PARSERS[parser_name]()
        self.sent = 0  # characters of text already sent (content, or named arguments)

    def final(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode in ("required", "named"):
            return None, calls_from_constrained(text, self.mode, self.name)
        if self.mode == "auto":
            return self.parser.parse(text)
        return text, []

    def _take(self, text: str, end: int) -> str:
        """The text from what was already sent up to `end`, now counted as sent."""
        new = text[self.sent : max(self.sent, end)]
        self.sent += len(new)
        return new

    def delta(self, text: str, finished: bool) -> tuple[str, list[dict] | None]:
        """(content to send now, tool_calls delta or None) for the choice's text so far."""
        if self.mode == "none":
            return self._take(text, len(text)), None
        if self.mode == "named":  # the text is the arguments: the call opens, then grows
            first = self.sent == 0
            new = self._take(text, len(text))
            if not (new or first):
                return "", None
            call = ToolCall(self.name, new).openai(0) if first else None
            return "", [call or {"index": 0, "function": {"arguments": new}}]
        if self.mode == "required":
            calls = self.final(text)[1] if finished else None
            return "", None if calls is None else [c.openai(i) for i, c in enumerate(calls)]
        if finished:  # auto
            _, calls = self.final(text)
            if calls:
                return "", [c.openai(i) for i, c in enumerate(calls)]
            return self._take(text, len(text)), None
        marker = self.parser.start
        end = text.find(marker)
        if end < 0:  # hold back a tail that may be the start of the marker
            tail = next(
                (k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if text.endswith(marker[:k])),
                0,
            )  # fmt: skip
            end = len(text) - tail
        return self._take(text, end), None
