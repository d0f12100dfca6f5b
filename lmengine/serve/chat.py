"""POST /v1/chat/completions (and LMDeploy's /v1/chat/completions_qos): messages through the
chat template (the tokenizer's or `--chat-template`), `n` choices in one Job, OpenAI's
`chat.completion` answer, whole or streamed, with chat logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmengine.serve.client import ServerContext
from lmengine.serve.convert import gen_configs
from lmengine.serve.errors import APIError
from lmengine.serve.jobs import Job
from lmengine.serve.logprobs import chat_logprobs, vllm_prompt_logprobs
from lmengine.serve.protocol import ChatCompletionRequest
from lmengine.serve.streaming import ChunkShape, finish_reason, run_job, stream_choices, wants_usage
from lmengine.serve.tools import (
    ToolOutput,
    chat_messages,
    template_takes_tools,
    tool_choice_mode,
    tool_constraint,
    tools_system_prompt,
)


async def create_chat_completion(
    client: ServerContext, body: ChatCompletionRequest, request: Request, endpoint: str
) -> dict | StreamingResponse:
    """Apply the template, submit one engine request per choice, and answer."""
    job, tool_mode = await submit_chat(client, body, request, endpoint)
    num_top = body.top_logprobs or 0
    return await run_job(
        job,
        request,
        body.stream,
        lambda: _whole(client, job, body, num_top, tool_mode),
        lambda: _stream(client, job, body, num_top, tool_mode),
    )


async def chat_prompt(
    client: ServerContext, body: ChatCompletionRequest
) -> tuple[list[int], tuple[str, str | None]]:
    """The prompt's token ids of the chat request `body` (its tools through the template, or
    in the system message when the template takes none) and its tool mode (mode, name)."""
    mode, name = tool_choice_mode(body)
    native = template_takes_tools(client.tokenizer, client.settings.chat_template)
    messages = chat_messages(body.messages, native)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if mode != "none" else []
    if tools and not native:  # the template has no tools: they go into the system message
        prompt = tools_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": prompt + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    ids = await client.off_loop(
        client.encode_chat, messages, body.add_generation_prompt, tools if native else None
    )
    return ids, (mode, name)


async def submit_chat(
    client: ServerContext, body: ChatCompletionRequest, request: Request, endpoint: str
) -> tuple[Job, tuple[str, str | None]]:
    """The chat request `body` through the template (tools in it or in a system message),
    submitted as a Job of one engine request per choice; with its tool mode (mode, function
    name), which `ToolOutput` reads the answer by. Every door that speaks chat (Responses,
    Anthropic's Messages) comes through here."""
    adapter = client.adapter_for(body.model)
    ids, (mode, name) = await chat_prompt(client, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    num_top = body.top_logprobs or 0
    logprobs = num_top if body.logprobs else None
    configs = gen_configs(body, 1, max_tokens, logprobs, client.session_len, body.prompt_logprobs)
    settings = client.settings
    # NOTE: beam search, ignore_eos and min_tokens take no constraint: under auto, their
    # calls are parsed from free text
    free = body.num_beams > 1 or body.ignore_eos or body.min_tokens > 0
    constrain_auto = settings.auto_tool_constraint and not free
    auto_parser = settings.tool_call_parser if constrain_auto else None
    constraint = tool_constraint(body, mode, name, auto_parser)
    if constraint is not None and configs[0].structured_outputs is not None:
        if mode != "auto":  # under auto, the client's own constraint wins
            raise APIError(400, "tool_choice with another output constraint", param="tool_choice")
        constraint = None
    if constraint is not None:  # the calls always parse
        for cfg in configs:
            cfg.structured_outputs = constraint
    if max_tokens is None:  # NOTE: no limit asked: up to the end of the context
        for cfg in configs:
            cfg.max_new_tokens = max(1, client.session_len - len(ids))
            cfg.min_new_tokens = min(cfg.min_new_tokens, cfg.max_new_tokens)
    job = client.new_job(endpoint, request)
    client.submit(job, [ids] * body.n, configs, adapter, body.priority, body.user_id or body.user)
    return job, (mode, name)


def _reason(resp, called: bool) -> str | None:
    """OpenAI's finish reason of a choice: "tool_calls" when it ended on its own with calls;
    a call cut by `max_tokens` finishes with "length" (its arguments are incomplete JSON)."""
    if called and resp.finish_reason == "stop":
        return "tool_calls"
    return finish_reason(resp)


def _whole(
    client: ServerContext, job: Job, body: ChatCompletionRequest, num_top: int, tool_mode
) -> dict:
    choices = []
    for i, c in enumerate(job.choices):
        resp = c.final
        logprobs = None
        if body.logprobs:
            logprobs = {"content": chat_logprobs(resp, num_top, client.token_text)}
        output = ToolOutput(*tool_mode, client.settings.tool_call_parser)
        content, calls = output.final(resp.text or "")
        message = {"role": "assistant", "content": content if calls else resp.text or ""}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": _reason(resp, bool(calls)),
            }
        )
    answer = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": client.model_name(body),
        "choices": choices,
        "usage": client.usage(job, body.n),
    }
    if body.prompt_logprobs is not None:  # vLLM: once, beside the choices (one prompt)
        first = job.choices[0]
        answer["prompt_logprobs"] = vllm_prompt_logprobs(
            first.input_ids, first.final, body.prompt_logprobs, client.token_text
        )
    return answer


def _stream(
    client: ServerContext, job: Job, body: ChatCompletionRequest, num_top: int, tool_mode
) -> AsyncIterator[str]:
    shape = ChunkShape(
        f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk", client.model_name(body)
    )
    opening = [
        shape.chunk(
            i, delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None
        )
        for i in range(len(job.choices))
    ]

    pending_prompt = [body.prompt_logprobs is not None] * len(job.choices)
    parser = client.settings.tool_call_parser
    outputs = [ToolOutput(*tool_mode, parser) for _ in job.choices]

    texts = [""] * len(job.choices)  # with tools: the text so far, which the parser reads

    def make_chunk(i: int, resp) -> dict | None:
        if outputs[i].mode == "none":
            delta, calls = resp.text or "", None
        else:
            texts[i] += resp.text or ""
            delta, calls = outputs[i].delta(texts[i], resp.finish_reason is not None)
        reason = _reason(resp, outputs[i].called)
        logprobs = None
        if body.logprobs:
            logprobs = {"content": chat_logprobs(resp, num_top, client.token_text)}
        extra = {}
        if pending_prompt[i]:  # vLLM's prompt_logprobs: in each choice's first chunk
            pending_prompt[i] = False
            extra["prompt_logprobs"] = vllm_prompt_logprobs(
                job.choices[i].input_ids, resp, body.prompt_logprobs, client.token_text
            )
        new_tokens = bool(resp.token_ids)  # NOTE: a chunk even without text (completions)
        if not (delta or new_tokens or calls or resp.finish_reason or extra):
            return None
        message = {"content": delta} if delta or (new_tokens and not calls) else {}
        if calls:
            message["tool_calls"] = calls
        return shape.chunk(i, delta=message, logprobs=logprobs, finish_reason=reason, **extra)

    usage = (lambda: client.usage(job, body.n)) if wants_usage(body) else None
    return stream_choices(job, shape, opening, make_chunk, usage)
