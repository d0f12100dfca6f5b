"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, over the
chat machinery.

A request becomes a chat request (`as_chat`): `system` a system message, text blocks the
message's text, an assistant's `tool_use` blocks its tool calls (the input as JSON
arguments), each `tool_result` a tool message; tools and `tool_choice` as chat's (`any`:
"required", `tool`: the named function, `disable_parallel_tool_use`: no parallel calls).
It runs through `submit_chat` like any chat request, so the template, tools, constraints,
limits, QoS and metrics are chat's. The answer is a `message` whose content is a text block
and one `tool_use` block per call, whole or as Anthropic's server-sent events
(`MessageEvents`); a failure after the events began is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from lmengine.engine.request import Response
from lmengine.serve.anthropic_protocol import CountTokensRequest, MessagesRequest
from lmengine.serve.chat import chat_prompt, submit_chat
from lmengine.serve.client import ServerContext
from lmengine.serve.convert import assistant_turn
from lmengine.serve.errors import APIError, generation_error
from lmengine.serve.jobs import Job
from lmengine.serve.protocol import ChatCompletionRequest
from lmengine.serve.streaming import run_job
from lmengine.serve.tools import ToolOutput

ToolMode = tuple[str, str | None]  # submit_chat's (tool choice mode, function name)


def _text(content) -> str:
    """A text, or the text of a list of text blocks."""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _assistant(message) -> dict:
    """An assistant message's text and tool_use blocks as one chat message (thinking
    blocks dropped)."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    text = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.id, b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"]
    return assistant_turn(text, calls)


def _user(message) -> list[dict]:
    """A user message's blocks as chat messages, in order: each run of text blocks a user
    message, each tool_result a tool message."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict] = []
    text: list[str] = []
    for block in message.content:
        if block.type == "text":
            text.append(block.text)
            continue
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text = []
        result = _text(block.content)
        if block.is_error:
            result = f"Error: {result}"
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def as_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that `body` asks for (sampling fields too, for a MessagesRequest)."""
    messages: list[dict] = []
    if body.system is not None and _text(body.system):
        messages.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        messages += _user(message) if message.role == "user" else [_assistant(message)]
    chat: dict = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}}
            for t in body.tools
        ]  # fmt: skip
    choice = body.tool_choice
    if choice is not None:
        named = {"type": "function", "function": {"name": getattr(choice, "name", "")}}
        kinds = {"auto": "auto", "any": "required", "none": "none", "tool": named}
        chat["tool_choice"] = kinds[choice.type]
        chat["parallel_tool_calls"] = not getattr(choice, "disable_parallel_tool_use", False)
    if isinstance(body, MessagesRequest):
        chat.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p if body.top_p is not None else 1.0,
            top_k=body.top_k or 0,
            stop=body.stop_sequences,
            stream=body.stream,
        )
        if body.metadata is not None and body.metadata.user_id is not None:
            chat["user_id"] = body.metadata.user_id
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # NOTE: the Messages body's ranges fit chat's: not expected
        raise APIError(400, f"invalid request: {e.errors()[0]['msg']}") from None


async def count_tokens(client: ServerContext, body: CountTokensRequest) -> dict:
    """The number of tokens of the prompt `body` makes (template and tools included)."""
    chat = as_chat(body)
    client.adapter_for(chat.model)  # 404 for a model not served
    ids, _ = await chat_prompt(client, chat)
    return {"input_tokens": len(ids)}


async def create_message(
    client: ServerContext, body: MessagesRequest, request: Request, endpoint: str
) -> dict | StreamingResponse:
    """Submit the conversation as a chat request and answer with the model's message."""
    chat = as_chat(body)
    job, tool_mode = await submit_chat(client, chat, request, endpoint)
    answer = MessageAnswer(client, body, job, tool_mode)
    return await run_job(job, request, body.stream, answer.whole, answer.events)


def tool_use_block(name: str, arguments: str) -> dict:
    """A tool_use block; `input` is the arguments' JSON object ({} when they are not one:
    a call cut short by max_tokens)."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    tool_input = parsed if isinstance(parsed, dict) else {}
    return {"type": "tool_use", "id": _new_id("toolu"), "name": name, "input": tool_input}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class MessageAnswer:
    """One Messages request's answer: the `message` object, whole (`whole`) or as the events
    that build it (`events`). Reads the job's responses; never submits or cancels."""

    def __init__(
        self, client: ServerContext, body: MessagesRequest, job: Job, tool_mode: ToolMode
    ) -> None:
        self.client, self.body, self.job, self.tool_mode = client, body, job, tool_mode
        self.id = _new_id("msg")

    def tool_output(self) -> ToolOutput:
        return ToolOutput(*self.tool_mode, self.client.settings.tool_call_parser)

    def stop(self, resp: Response, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished response `resp`."""
        if resp.finish_reason == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        word = resp.stop_reason
        if isinstance(word, str) and word in (self.body.stop_sequences or ()):
            return "stop_sequence", word
        return "end_turn", None

    def usage(self) -> dict:
        u = self.client.usage(self.job, 1)
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"]}

    def message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict):
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.client.model_name(self.body),
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def whole(self) -> dict:
        resp = self.job.choices[0].final or Response()
        text, calls = self.tool_output().final(resp.text or "")
        if not calls:
            text = resp.text or ""
        content = [{"type": "text", "text": text}] if text else []
        content += [tool_use_block(c.name, c.arguments) for c in calls]
        return self.message(content, self.stop(resp, bool(calls)), self.usage())

    def events(self) -> AsyncIterator[str]:
        return MessageEvents(self).run()


def sse(kind: str, **fields) -> str:
    """One server-sent event of Anthropic's stream: its type named in `event:` and in data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class MessageEvents:
    """The events of one streamed message: `message_start` (no content yet) and a `ping`;
    per content block `content_block_start`, its deltas (`text_delta`, `input_json_delta`)
    and `content_block_stop`; `message_delta` (stop reason, usage) and `message_stop`."""

    def __init__(self, answer: MessageAnswer) -> None:
        self.answer = answer
        self.num_blocks = 0
        self.open: str | None = None  # the type of the block being written (the last one)
        self.calls: dict[int, int] = {}  # ToolOutput's call index -> block index

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", index=self.num_blocks - 1)]

    def start(self, block: dict) -> list[str]:
        """Close the open block and start `block`."""
        events = self.close()
        events.append(sse("content_block_start", index=self.num_blocks, content_block=block))
        self.open, self.num_blocks = block["type"], self.num_blocks + 1
        return events

    def add_text(self, text: str) -> list[str]:
        events = [] if self.open == "text" else self.start({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return events + [sse("content_block_delta", index=self.num_blocks - 1, delta=delta)]

    def add_call(self, delta: dict) -> list[str]:
        """One of ToolOutput's chat `tool_calls` deltas: a call opens (with `id`) or grows."""
        events = []
        if "id" in delta:
            block = {"type": "tool_use", "id": _new_id("toolu"),
                     "name": delta["function"]["name"], "input": {}}  # fmt: skip
            events += self.start(block)
            self.calls[delta["index"]] = self.num_blocks - 1
        arguments = delta["function"].get("arguments", "")
        if arguments:
            piece = {"type": "input_json_delta", "partial_json": arguments}
            index = self.calls[delta["index"]]
            events.append(sse("content_block_delta", index=index, delta=piece))
        return events

    async def run(self) -> AsyncIterator[str]:
        answer = self.answer
        first = answer.job.choices[0].first or Response()
        usage = {"input_tokens": first.input_token_len, "output_tokens": 0}
        yield sse("message_start", message=answer.message([], (None, None), usage))
        yield sse("ping")
        output = answer.tool_output()
        text = ""
        final = Response()
        try:
            async for _, delta in answer.job.responses():
                if delta.finish_reason == "error":
                    raise generation_error(delta.error or "generation failed")
                text += delta.text or ""
                content, calls = output.delta(text, delta.finish_reason is not None)
                for event in self.add_text(content) if content else []:
                    yield event
                for call in calls or []:
                    for event in self.add_call(call):
                        yield event
                if delta.finish_reason is not None:
                    final = answer.job.choices[0].final or delta
        except APIError as err:  # failed, timed out or shut down after the events began
            yield sse("error", error=err.anthropic_body()["error"])
            return
        for event in self.close():
            yield event
        stop_reason, stop_sequence = answer.stop(final, output.called)
        end = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield sse("message_delta", delta=end, usage=answer.usage())
        yield sse("message_stop")
