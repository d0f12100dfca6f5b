"""POST /v1/responses (OpenAI's Responses API) over the chat machinery.

A request becomes a chat request (`as_chat`): `instructions` a system message, input items
messages (a run of `function_call`s one assistant message with tool calls, each
`function_call_output` a tool message), function tools and `tool_choice` as chat's, and
`text.format` as `response_format`. It runs through `submit_chat` like any chat request, so
the template, tools, constraints, limits, QoS and metrics are chat's. The answer is a
`response` object whose output items are a `message` (text) and one `function_call` per
call, or the typed events that build it (`ResponseEvents`). Responses are kept in memory
(`ResponseStore`, bounded) for `previous_response_id` and GET /v1/responses/{id}.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmengine.serve.chat import submit_chat
from lmengine.serve.client import ServerContext
from lmengine.serve.convert import assistant_turn
from lmengine.serve.errors import APIError, generation_error
from lmengine.serve.jobs import Job
from lmengine.serve.protocol import ChatCompletionRequest
from lmengine.serve.responses_protocol import ResponsesRequest
from lmengine.serve.streaming import run_job
from lmengine.serve.tools import ToolOutput

MAX_STORED_RESPONSES = 1024


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """The last MAX_STORED_RESPONSES stored responses, each with the conversation it ends
    (chat messages, its own output included), oldest dropped first."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, history: list[dict]) -> None:
        self.entries[response["id"]] = (response, history)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(
                404, f"no stored response with id {response_id!r}", code="not_found", param=param
            )
        return entry


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if p.type != "refusal" else p.refusal for p in content)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages (without `instructions`)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict] = []
    for item in body.input:
        if item.type == "message":
            messages.append({"role": item.role, "content": _text_of(item.content)})
        elif item.type == "function_call":
            turn = assistant_turn("", [(item.call_id, item.name, item.arguments)])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"] += turn["tool_calls"]  # parallel calls: one assistant turn
            else:
                messages.append(turn)
        elif item.type == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)}
            )
    return messages


def as_chat(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request that answers `body` after the stored conversation `history`."""
    messages = list(history)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    messages += input_messages(body)
    if not messages:
        raise APIError(400, "the input holds no message", param="input")
    chat: dict = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user,
        "stop": body.stop,
        "seed": body.seed,
        "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty,
        "priority": body.priority,
        "user_id": body.user_id,
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type", "strict"})}
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if isinstance(choice, str):
            chat["tool_choice"] = choice
        else:
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return ChatCompletionRequest.model_validate(chat)


async def create_response(
    client: ServerContext, store: ResponseStore, body: ResponsesRequest, request: Request
) -> dict | StreamingResponse:
    history: list[dict] = []
    if body.previous_response_id is not None:
        _, history = store.get(body.previous_response_id, "previous_response_id")
    chat = as_chat(body, history)
    job, tool_mode = await submit_chat(client, chat, request, "responses")
    answer = Answer(client, store, body, chat, job, tool_mode)
    return await run_job(job, request, body.stream, answer.whole, answer.events)


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}  # fmt: skip


def call_item(item_id: str, call_id: str, name: str, arguments: str, status="completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}  # fmt: skip


class Answer:
    """One response's answer: the `response` object, whole (`whole`) or as the typed events
    that build it (`events`); stored at the end when the request asks."""

    def __init__(
        self,
        client: ServerContext,
        store: ResponseStore,
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        job: Job,
        tool_mode: tuple[str, str | None],
    ) -> None:
        self.client, self.store, self.body, self.chat, self.job = client, store, body, chat, job
        self.tool_mode = tool_mode
        self.id = _new_id("resp")
        self.created = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.client.model_name(body),
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": _dump(body.tool_choice) or "auto",
            "tools": [t.model_dump() for t in body.tools or []],
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": usage,
            "user": body.user,
        }

    def usage(self) -> dict:
        u = self.client.usage(self.job, 1)
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }

    def status(self) -> str:
        final = self.job.choices[0].final
        cut = final is not None and final.finish_reason == "length"
        return "incomplete" if cut else "completed"

    def finish(self, output: list[dict]) -> dict:
        """The finished response object, stored with its conversation when asked."""
        response = self.response(self.status(), output, self.usage())
        if self.body.store:
            history = [m.model_dump(exclude_none=True) for m in self.chat.messages]
            if self.body.instructions:
                history = history[1:]  # instructions are not carried over
            self.store.put(response, history + [_as_message(output)])
        return response

    def whole(self) -> dict:
        final = self.job.choices[0].final
        mode, name = self.tool_mode
        parser = self.client.settings.tool_call_parser
        content, calls = ToolOutput(mode, name, parser).final(final.text or "" if final else "")
        output = []
        if content or not calls:
            output.append(message_item(_new_id("msg"), content or ""))
        for call in calls:
            output.append(call_item(_new_id("fc"), _new_id("call"), call.name, call.arguments))
        return self.finish(output)

    def events(self) -> AsyncIterator[str]:
        return ResponseEvents(self).run()


def _dump(value):
    return value.model_dump() if hasattr(value, "model_dump") else value


def _as_message(output: list[dict]) -> dict:
    """A response's output items as one assistant chat message (for the next turn)."""
    text = "".join(p["text"] for item in output if item["type"] == "message"
                   for p in item["content"])  # fmt: skip
    calls = [(item["call_id"], item["name"], item["arguments"])
             for item in output if item["type"] == "function_call"]  # fmt: skip
    return assistant_turn(text, calls)


class ResponseEvents:
    """The typed server-sent events of one streamed response: `response.created`, then per
    output item `output_item.added`, its deltas (`output_text.delta`,
    `function_call_arguments.delta`), its `.done` events and `output_item.done`, and
    `response.completed` (or `response.incomplete`) with the whole response."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.sequence = 0
        self.output: list[dict] = []  # the items so far (text and arguments as streamed)
        self.open: int | None = None  # the index of the item still being written
        self.calls: dict[int, int] = {}  # ToolOutput's call index -> output index

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def close_item(self) -> list[str]:
        """The `.done` events of the item being written, if any."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.output[index]
        item["status"] = "completed"
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            return [
                self.event("response.output_text.done", **at, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **at, content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=item),
            ]  # fmt: skip
        return [
            self.event("response.function_call_arguments.done", **at, name=item["name"],
                       arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def add_text(self, text: str) -> list[str]:
        events = []
        item = self.output[self.open] if self.open is not None else None
        if item is None or item["type"] != "message":
            events += self.close_item()
            item = message_item(_new_id("msg"), "", "in_progress")
            self.output.append(item)
            self.open = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=self.open,
                                     item={**item, "content": []}))  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"] = [part]
            at = {"item_id": item["id"], "output_index": self.open, "content_index": 0}
            events.append(self.event("response.content_part.added", **at, part=part))
        item["content"][0]["text"] += text
        at = {"item_id": item["id"], "output_index": self.open, "content_index": 0}
        events.append(self.event("response.output_text.delta", **at, delta=text, logprobs=[]))
        return events

    def add_call(self, delta: dict) -> list[str]:
        """One of ToolOutput's chat `tool_calls` deltas: a call opens (with `id`) or grows."""
        events = []
        arguments = delta["function"].get("arguments", "")
        if "id" in delta:  # a new call: the item before it is done
            events += self.close_item()
            item = call_item(_new_id("fc"), delta["id"], delta["function"]["name"], "",
                             "in_progress")  # fmt: skip
            self.output.append(item)
            self.open = self.calls[delta["index"]] = len(self.output) - 1
            events.append(self.event("response.output_item.added", output_index=self.open,
                                     item=dict(item)))  # fmt: skip
        index = self.calls[delta["index"]]
        if arguments:
            item = self.output[index]
            item["arguments"] += arguments
            at = {"item_id": item["id"], "output_index": index}
            events.append(
                self.event("response.function_call_arguments.delta", **at, delta=arguments)
            )
        return events

    async def run(self) -> AsyncIterator[str]:
        answer = self.answer
        start = answer.response("in_progress", [], None)
        yield self.event("response.created", response=start)
        yield self.event("response.in_progress", response=start)
        mode, name = answer.tool_mode
        output = ToolOutput(mode, name, answer.client.settings.tool_call_parser)
        text = ""
        async for _, delta in answer.job.responses():
            if delta.finish_reason == "error":
                err = generation_error(delta.error or "generation failed")
                yield self.event("error", code=err.code, message=err.message, param=err.param)
                return
            finished = delta.finish_reason is not None
            if output.mode == "none":
                content, calls = delta.text or "", None
            else:
                text += delta.text or ""
                content, calls = output.delta(text, finished)
            for event in self.add_text(content) if content else []:
                yield event
            for call in calls or []:
                for event in self.add_call(call):
                    yield event
        if not self.output:  # no text and no call: an empty message
            for event in self.add_text(""):
                yield event
        for event in self.close_item():
            yield event
        response = answer.finish(self.output)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=response)
