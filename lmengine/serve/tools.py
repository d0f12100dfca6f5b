"""Tool calling for chat completions: the tools into the prompt, the constraint that
`tool_choice` implies, and the model's text back into OpenAI's `tool_calls`.

- `tool_choice="auto"`: the tools go into the prompt (through the chat template when it takes
  `tools`, else as a system message in the Hermes style most instruct models were trained on,
  with tool results as `<tool_response>` user turns). The model decides whether to call; once
  it starts the parser's call markup (`<tool` for hermes, `{"name": ` for llama3_json), the
  rest of the call is constrained to the functions' schemas (an xgrammar structural tag), so
  a call that starts always parses. `--no-auto-tool-constraint` leaves `auto` free.
- `"required"`: the output is constrained to a JSON array of calls `[{"name", "arguments"}]`
  over the given functions (one call when `parallel_tool_calls` is false), so it always parses.
- a named function: the output is constrained to that function's parameters schema; it is the
  call's `arguments`.
- `"none"`: the tools are left out; plain text.

A call's `arguments` are the JSON text the model wrote (found with `written_calls`), so a
streamed call's argument pieces add up to the same text as the whole answer's.

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


# the head of a call as models write it: {"name": "...", "arguments" (or "parameters"): ...
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def written_calls(text: str) -> list[tuple[ToolCall, bool]]:
    """The calls written `{"name": ..., "arguments": ...}` in `text` as far as it goes, each
    with its arguments' JSON text as written and whether that text is complete."""
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while (head := _CALL_HEAD.search(text, at)) is not None:
        name = json.loads(head.group(1))
        try:
            _, end = decoder.raw_decode(text, head.end())
        except json.JSONDecodeError:  # still being written (or cut): what there is so far
            calls.append((ToolCall(name, text[head.end() :]), False))
            break
        calls.append((ToolCall(name, text[head.end() : end]), True))
        at = end
    return calls


def _call_of(obj, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def calls_of_json(raw: str, obj, arguments_key: str = "arguments") -> list[ToolCall]:
    """The calls in parsed JSON `obj` (a call or a list of calls) whose text is `raw`: with
    the arguments as written when the calls are written name first, else re-serialized."""
    parsed = [c for c in map(_call_of, obj if isinstance(obj, list) else [obj]) if c]
    written = [c for c, complete in written_calls(raw) if complete]
    return written if [c.name for c in written] == [c.name for c in parsed] else parsed


def call_schema(functions: list) -> dict:
    """One call `{"name", "arguments"}` to any of the functions, as a JSON schema."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f.name},
                    "arguments": f.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for f in functions
        ]
    }


def calls_schema(functions: list, parallel: bool) -> dict:
    """A JSON array of one or more calls (at most one unless parallel)."""
    schema = {"type": "array", "items": call_schema(functions), "minItems": 1}
    return schema if parallel else {**schema, "maxItems": 1}


def _json_content(schema: dict) -> dict:
    # NOTE: at most one whitespace character in a row: a weak model given more fills its
    # budget with spaces and newlines
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def _triggered(trigger: str, tags: list[dict], parallel: bool) -> dict:
    """Free text until `trigger`, then one of `tags` (then free text again, or, when calls
    are not parallel, the end)."""
    fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags}
    fmt["stop_after_first"] = not parallel
    return {"structural_tag": {"type": "structural_tag", "format": fmt}}


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (or a JSON list of
    calls in one block); the text outside the blocks is the content."""

    start = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                calls += calls_of_json(body, json.loads(body))
            except json.JSONDecodeError:
                continue
        if not calls:
            return text, []
        content = self._BLOCK.sub("", text).strip()
        return content or None, calls

    def auto_constraint(self, functions: list, parallel: bool) -> dict:
        """Free text, but markup that starts `<tool` is a `<tool_call>` block of calls (an
        object or a list, a newline allowed on either side, as Qwen and SmolLM2 write)."""
        newline = {"type": "regex", "pattern": "\\n?"}
        one = call_schema(functions)
        content = {"anyOf": [one, calls_schema(functions, parallel)]}
        body = {"type": "sequence", "elements": [newline, _json_content(content), newline]}
        tag = {"begin": self.start, "content": body, "end": "</tool_call>"}
        return _triggered("<tool", [tag], parallel)


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
            found = calls_of_json(body[at:end], obj, "parameters")
            if not found:
                return text, []
            calls += found
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return None, calls

    def auto_constraint(self, functions: list, parallel: bool) -> dict:
        """Free text, but an object that starts `{"name": ` is a call of one function."""
        tags = [
            {
                "begin": f'{{"name": {json.dumps(f.name)}, "parameters": ',
                "content": _json_content(f.parameters or {"type": "object"}),
                "end": "}",
            }
            for f in functions
        ]
        return _triggered('{"name": ', tags, parallel)


TOOL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_choice_mode(body) -> tuple[str, str | None]:
    """(mode, function name): mode is "none", "auto", "required" or "named"."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return "none", None
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    name = choice.function.name
    if name not in {t.function.name for t in body.tools}:
        raise APIError(400, f"tool_choice names an unknown function {name!r}", param="tool_choice")
    return "named", name


def tool_constraint(body, mode: str, name: str | None, auto_parser: str | None) -> dict | None:
    """The structured_outputs spec that `tool_choice` implies: a named function's parameters,
    `required`'s array of calls, or (with `auto_parser`) the parser's constraint on calls the
    model starts under `auto`."""
    functions = [t.function for t in body.tools or []]
    if mode == "named":
        return {
            "json": next(f for f in functions if f.name == name).parameters or {"type": "object"}
        }
    if mode == "required":
        return {"json": calls_schema(functions, body.parallel_tool_calls)}
    if mode == "auto" and auto_parser is not None:
        return TOOL_PARSERS[auto_parser]().auto_constraint(functions, body.parallel_tool_calls)
    return None


def calls_from_constrained(text: str, mode: str, name: str | None) -> list[ToolCall]:
    """The calls of a `required` or named-function output (JSON the grammar produced); cut
    by `max_tokens`, the calls as far as they were written (as they were streamed)."""
    if mode == "named":
        return [ToolCall(name, text)]
    try:
        return calls_of_json(text, json.loads(text))
    except json.JSONDecodeError:
        return [call for call, _ in written_calls(text)]


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
    """An assistant message's `tool_calls` as {"name", "arguments": object} (arguments that
    are not JSON stay the text they are)."""
    calls = []
    for c in message.tool_calls:
        try:
            args = json.loads(c.function.arguments)
        except json.JSONDecodeError:
            args = c.function.arguments
        calls.append({"name": c.function.name, "arguments": args})
    return calls


def chat_messages(messages, native_tools: bool) -> list[dict]:
    """The request's messages for the chat template. With a template that takes tools, the
    assistant's `tool_calls` stay structured (arguments as objects); otherwise tool calls are
    written as the Hermes-style text the tools system prompt asks for, and tool results as
    `<tool_response>` user turns (as Qwen's template writes them)."""
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
        if m.role == "tool" and native_tools and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        elif m.role == "tool" and not native_tools:  # a template without a tool role
            content = f"<tool_response>\n{message['content']}\n</tool_response>"
            message = {"role": "user", "content": content}
        out.append(message)
    return out


class ToolOutput:
    """One choice's text turned into content and tool calls, whole (`final`) or step by step
    (`delta`). Streamed, content goes out until the parser's start marker may begin; each call
    then opens (id and name) as soon as its name is written and its arguments follow as they
    are written; calls found only in the whole text (another key order) come at the end."""

    def __init__(self, mode: str, name: str | None, parser_name: str) -> None:
        self.mode, self.name = mode, name
        self.parser = TOOL_PARSERS[parser_name]()
        self.sent = 0  # characters of text already sent (content, or named arguments)
        self.calls_at: int | None = None  # where the calls begin in the text (auto)
        self.args_sent: list[int] = []  # characters of each streamed call's arguments sent
        self.called = False  # whether the finished text holds calls (finish_reason)

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

    def _call_deltas(self, text: str) -> list[dict]:
        """`delta.tool_calls` entries for what `text` (from the calls on) adds to the calls
        streamed so far: a new call opens with its id and name."""
        deltas = []
        for i, (call, _) in enumerate(written_calls(text)):
            opens = i == len(self.args_sent)
            if opens:
                self.args_sent.append(0)
            new = call.arguments[self.args_sent[i] :]
            self.args_sent[i] += len(new)
            if opens:
                deltas.append(ToolCall(call.name, new).openai(i))
            elif new:
                deltas.append({"index": i, "function": {"arguments": new}})
        return deltas

    def _auto_step(self, text: str) -> tuple[str, list[dict]]:
        """Content up to where a call may begin, and the call deltas after it."""
        if self.calls_at is None:
            marker = self.parser.start
            at = text.find(marker)
            if at < 0:  # hold back a tail that may be the start of the marker
                tail = next(
                    (k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                     if text.endswith(marker[:k])),
                    0,
                )  # fmt: skip
                return self._take(text, len(text) - tail), []
            self.calls_at = at
            return self._take(text, at), self._call_deltas(text[at:])
        return "", self._call_deltas(text[self.calls_at :])

    def delta(self, text: str, finished: bool) -> tuple[str, list[dict] | None]:
        """(content to send now, tool_calls delta or None) for the choice's text so far."""
        if self.mode == "none":
            return self._take(text, len(text)), None
        if self.mode == "named":  # the text is the arguments: the call opens, then grows
            self.called = finished
            first = self.sent == 0
            new = self._take(text, len(text))
            if not (new or first):
                return "", None
            call = ToolCall(self.name, new).openai(0) if first else None
            return "", [call or {"index": 0, "function": {"arguments": new}}]
        content, deltas = ("", self._call_deltas(text)) if self.mode == "required" else (
            self._auto_step(text)
        )  # fmt: skip
        if finished:
            final_content, calls = self.final(text)
            self.called = bool(calls)
            if self.mode == "auto" and not (calls or self.args_sent):  # no call after all
                return content + self._take(text, len(text)), None
            # calls written in another key order were not streamed: they come whole
            deltas += [c.openai(i) for i, c in enumerate(calls) if i >= len(self.args_sent)]
            prefix = text[: self.sent]  # content after the calls (auto)
            if final_content and final_content.startswith(prefix):
                content += final_content[len(prefix) :]
        return content, deltas or None
