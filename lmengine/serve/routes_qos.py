"""The QoS router: LMDeploy's /v1/completions_qos, /v1/chat/completions_qos and
/v1/chat/interactive_qos. Without a QoS config the three paths answer 404 and stay out of
the OpenAPI document."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from lmengine.engine.request import Response
from lmengine.serve.auth import api_key_check
from lmengine.serve.chat import create_chat_completion
from lmengine.serve.client import ServerContext
from lmengine.serve.completions import create_completion
from lmengine.serve.convert import interactive_gen_config, text_of
from lmengine.serve.errors import GENERATION_RESPONSES, APIError
from lmengine.serve.protocol import (
    ChatCompletionRequestQos,
    CompletionRequestQos,
    InteractiveRequestQos,
)
from lmengine.serve.streaming import NDJSON, finish_reason, run_job

QOS_PATHS = ("/v1/completions_qos", "/v1/chat/completions_qos", "/v1/chat/interactive_qos")


def qos_router(client: ServerContext) -> APIRouter:
    """The QoS endpoints over `client` when `settings.qos_enabled`, else hidden 404s."""
    if not client.settings.qos_enabled:
        return _qos_off_router()
    router = APIRouter(
        tags=["qos"], dependencies=[Depends(api_key_check(client.settings.api_keys))]
    )

    @router.post("/v1/completions_qos", responses=GENERATION_RESPONSES)
    async def v1_completions_qos(body: CompletionRequestQos, request: Request):
        return await create_completion(client, body, request, "completions_qos")

    @router.post("/v1/chat/completions_qos", responses=GENERATION_RESPONSES)
    async def v1_chat_completions_qos(body: ChatCompletionRequestQos, request: Request):
        return await create_chat_completion(client, body, request, "chat_completions_qos")

    @router.post("/v1/chat/interactive_qos", responses=INTERACTIVE_RESPONSES)
    async def v1_chat_interactive_qos(body: InteractiveRequestQos, request: Request):
        """One turn of a chat session. NOTE: the server keeps each session's messages and
        sends the whole history every turn (with prefix caching the engine reuses its KV)."""
        return await interactive_turn(client, body, request)

    return router


# a turn's answer: JSON, or newline-delimited JSON when streamed (LMDeploy's format)
INTERACTIVE_RESPONSES = {
    **GENERATION_RESPONSES,
    200: {"content": {"application/json": {}, "application/x-ndjson": {}}},
}


def _qos_off_router() -> APIRouter:
    router = APIRouter()

    async def qos_off(request: Request):
        raise APIError(404, "QoS is off: start the server with --qos-config-path", code="not_found")

    for path in QOS_PATHS:
        router.add_api_route(path, qos_off, methods=["POST"], include_in_schema=False)
    return router


async def interactive_turn(
    client: ServerContext, body: InteractiveRequestQos, request: Request
) -> dict | StreamingResponse:
    """Run one turn of session `body.session_id` (-1: a one-off turn without history), or
    cancel it; the session keeps the turn only when it ends with "stop" or "length"."""
    sid = body.session_id
    session = client.sessions.get(sid) if sid >= 0 else None
    if body.cancel:
        if session is not None and session.get("job") is not None:
            session["job"].cancel("cancelled by the client")
        client.sessions.pop(sid, None)
        return {
            "text": "",
            "tokens": 0,
            "input_tokens": 0,
            "history_tokens": 0,
            "finish_reason": "abort",
        }
    if session is None:
        session = {"messages": [], "num_tokens": 0, "job": None}
    if session["job"] is not None:
        raise APIError(400, f"session {sid} already has a running turn", param="session_id")
    if isinstance(body.prompt, str):
        turn = [{"role": "user", "content": body.prompt}]
    else:
        turn = [{"role": m.role, "content": text_of(m)} for m in body.prompt]
    messages = session["messages"] + turn
    ids = await client.off_loop(client.encode_chat, messages)
    history_tokens = session["num_tokens"]
    max_tokens = min(body.request_output_len, max(1, client.session_len - len(ids)))
    cfg = interactive_gen_config(body, max_tokens)
    job = client.new_job("interactive_qos", request)
    client.submit(job, [ids], [cfg], None, body.priority, body.user_id)
    if sid >= 0:
        session["job"] = job
        client.keep_session(sid, session)

    def result(resp: Response, text: str) -> dict:
        return {
            "text": text,
            "tokens": resp.generate_token_len,
            "input_tokens": resp.input_token_len,
            "history_tokens": history_tokens,
            "finish_reason": finish_reason(resp),
        }

    def close_turn() -> None:
        session["job"] = None
        final = job.choices[0].final
        keep = body.interactive_mode and sid >= 0
        if keep and final is not None and final.finish_reason in ("stop", "length"):
            session["messages"] = messages + [{"role": "assistant", "content": final.text or ""}]
            session["num_tokens"] = final.input_token_len + final.generate_token_len
        elif not keep:
            client.sessions.pop(sid, None)

    def whole() -> dict:
        close_turn()
        final = job.choices[0].final
        return result(final, final.text or "")

    async def stream():
        try:
            async for _, delta in job.responses():
                yield NDJSON.event(result(delta, delta.text or ""))
        finally:
            close_turn()

    try:
        return await run_job(job, request, body.stream, whole, stream, NDJSON)
    except BaseException:
        session["job"] = None
        if not body.interactive_mode:
            client.sessions.pop(sid, None)
        raise
