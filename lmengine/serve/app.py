"""The OpenAI-compatible HTTP API over one Engine (FastAPI).

`build_app(engine, settings)` returns the ASGI app. Handlers turn a request body into token
ids and GenerationConfigs, run them as a `Job` (one engine request per choice) and shape the
responses as OpenAI does, streaming (SSE) or not. The engine runs in its own thread; nothing
here touches the scheduler or the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmengine.config import GenerationConfig
from lmengine.engine.request import Response
from lmengine.serve.jobs import APIError, Job, ResponseRouter, engine_error
from lmengine.serve.metrics import ServerMetrics
from lmengine.serve.protocol import (
    MAX_CHOICES,
    MAX_STOP_WORDS,
    ChatCompletionRequest,
    ChatCompletionRequestQos,
    ChatMessage,
    CompletionRequest,
    CompletionRequestQos,
    InteractiveRequestQos,
)

logger = logging.getLogger("lmengine.serve")

MIN_LOGPROB = -9999.0  # NOTE: JSON has no -inf; OpenAI and vLLM clamp the same way
FINISH_REASONS = {"stop": "stop", "length": "length", "cancel": "abort", "error": "error"}


@dataclass
class ServerSettings:
    """What the HTTP layer adds to the engine (each one a `lmengine serve` flag)."""

    model_name: str  # the id clients put in `model`
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed
    max_queued_requests: int = 0  # choices waiting for their first token; 0: no limit
    request_timeout: float = 0.0  # seconds; 0: none
    chat_template: str | None = None  # Jinja source replacing the tokenizer's template
    qos_enabled: bool = False


# ---- request -> engine inputs -------------------------------------------------------------------
def _text_of(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def _stop_words(stop) -> list[str] | None:
    words = [stop] if isinstance(stop, str) else list(stop or [])
    words = [w for w in words if w]
    if len(words) > MAX_STOP_WORDS:
        raise APIError(
            400, f"at most {MAX_STOP_WORDS} stop strings, got {len(words)}", param="stop"
        )
    return words or None


def _gen_configs(
    body, num_prompts: int, max_tokens: int | None, logprobs: int | None, session_len: int
) -> list[GenerationConfig]:
    """One GenerationConfig per choice (prompt-major: prompt i, choice j -> i * n + j)."""
    if max_tokens is not None and max_tokens > session_len:
        raise APIError(
            400,
            f"max_tokens={max_tokens} exceeds the model's context length of {session_len} tokens",
            param="max_tokens",
        )
    beam = {}
    if body.num_beams > 1:  # NOTE: one beam search per choice would repeat the same search
        if body.n > 1:
            raise APIError(400, "num_beams > 1 needs n == 1", param="n")
        beam = dict(
            num_beams=body.num_beams,
            length_penalty=body.length_penalty,
            early_stopping=body.early_stopping,
        )
    configs = []
    for _ in range(num_prompts):
        for j in range(body.n):
            seed = body.seed
            if seed is not None:
                seed = (seed + j) % 2**63  # NOTE: n choices with one seed must still differ
            try:
                cfg = GenerationConfig(
                    max_new_tokens=max_tokens or session_len,
                    min_new_tokens=body.min_tokens,
                    do_sample=body.temperature > 0 and not beam,
                    temperature=body.temperature if body.temperature > 0 else 1.0,
                    top_k=max(body.top_k, 0),
                    top_p=body.top_p,
                    repetition_penalty=body.repetition_penalty,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    stop_words=_stop_words(body.stop),
                    stop_token_ids=body.stop_token_ids,
                    ignore_eos=body.ignore_eos,
                    random_seed=seed,
                    logprobs=logprobs,
                    skip_special_tokens=body.skip_special_tokens,
                    **beam,
                )
            except ValueError as e:
                raise APIError(400, str(e)) from None
            configs.append(cfg)
    return configs


class OpenAIServer:
    """The handlers' shared state: the engine, the router, metrics and chat sessions."""

    def __init__(self, engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.session_len: int = engine.session_len
        self.metrics = ServerMetrics()
        self.router: ResponseRouter | None = None  # built on the event loop at startup
        self.sessions: dict[int, dict] = {}  # interactive session id -> history
        self.created = int(time.time())
        self.is_shutting_down = lambda: False
        self._token_text: dict[int, str] = {}

    # ---- helpers ------------------------------------------------------------------------------
    def adapter_for(self, model: str | None) -> str | None:
        """The adapter a `model` field names (None: the base model); 404 when unknown."""
        if model is None or model == self.settings.model_name:
            return None
        # NOTE: the engine's current names, so adapters added at run time are served too
        names = getattr(self.engine, "adapter_names", None)
        if model in (names if names is not None else self.engine.engine_config.adapters or {}):
            return model
        raise APIError(
            404, f"the model {model!r} does not exist", "invalid_request_error", "model_not_found"
        )

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        template = self.settings.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template: use /v1/completions")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as e:  # a template that refuses these messages (roles, order)
            raise APIError(400, f"chat template failed on these messages: {e}") from None
        return list(ids)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def new_job(self, endpoint: str) -> Job:
        if self.is_shutting_down():
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", "service_unavailable")
        return Job(
            self.engine,
            self.router,
            self.metrics,
            endpoint,
            self.settings.request_timeout or None,
        )

    def check_queue(self, num_choices: int) -> None:
        limit = self.settings.max_queued_requests
        if limit and self.metrics.num_queued + num_choices > limit:
            raise APIError(
                429,
                f"too many queued requests ({self.metrics.num_queued} waiting, limit {limit})",
                "rate_limit_exceeded",
                "too_many_requests",
                headers={"Retry-After": "1"},
            )

    def usage(self, job: Job, n: int) -> dict:
        """Prompt tokens counted once per prompt (choices i * n), as OpenAI does."""
        finals = [c.final or Response() for c in job.choices]
        prompt = sum(r.input_token_len for r in finals[::n])
        completion = sum(r.generate_token_len for r in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    # ---- logprobs -----------------------------------------------------------------------------
    def chat_logprobs(self, resp: Response, start: int, num_top: int) -> list[dict]:
        out = []
        for tok, dist in zip(resp.token_ids[start:], (resp.logprobs or [])[start:]):
            text = self.token_text(tok)
            top = sorted(dist.items(), key=lambda kv: -kv[1])[:num_top]
            out.append(
                {
                    "token": text,
                    "logprob": max(dist.get(tok, MIN_LOGPROB), MIN_LOGPROB),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": max(lp, MIN_LOGPROB),
                            "bytes": list(self.token_text(t).encode("utf-8")),
                        }
                        for t, lp in top
                    ],
                }
            )
        return out

    def completion_logprobs(
        self, resp: Response, start: int, num_top: int, offset: int
    ) -> tuple[dict, int]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, dist in zip(resp.token_ids[start:], (resp.logprobs or [])[start:]):
            text = self.token_text(tok)
            tokens.append(text)
            token_lps.append(max(dist.get(tok, MIN_LOGPROB), MIN_LOGPROB))
            top = sorted(dist.items(), key=lambda kv: -kv[1])[:num_top]
            tops.append({self.token_text(t): max(lp, MIN_LOGPROB) for t, lp in top})
            offsets.append(offset)
            offset += len(text)
        body = {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
        return body, offset


# ---- the app ------------------------------------------------------------------------------------
def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _finish(resp: Response) -> str | None:
    return FINISH_REASONS.get(resp.finish_reason) if resp.finish_reason else None


def build_app(engine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine` (already started; closed at app shutdown)."""
    server = OpenAIServer(engine, settings)

    async def lifespan(app: FastAPI):
        server.router = ResponseRouter(asyncio.get_running_loop())
        yield
        for job in {id(j): j for j in server.router.jobs.values()}.values():
            job.cancel("server shutdown")
        await asyncio.to_thread(engine.close)

    app = FastAPI(
        title="lmengine",
        description="OpenAI-compatible API of lmengine, with LMDeploy's QoS endpoints",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.server = server

    # ---- errors: always OpenAI's body ---------------------------------------------------------
    def error_json(err: APIError) -> JSONResponse:
        server.metrics.count_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_json(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        problems = []
        param = None
        for e in err.errors()[:3]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            problems.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        return error_json(APIError(400, "invalid request: " + "; ".join(problems), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        code = "not_found" if err.status_code == 404 else None
        return error_json(APIError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_json(APIError(500, f"internal error: {type(err).__name__}", "server_error"))

    def check_key(request: Request) -> None:
        if not settings.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in settings.api_keys:
            raise APIError(
                401, "invalid or missing API key", "invalid_request_error", "invalid_api_key"
            )

    auth = [Depends(check_key)]

    # ---- health and metrics -------------------------------------------------------------------
    @app.get("/health", tags=["health"])
    async def health():
        if not engine.is_alive:
            raise APIError(503, "the engine is not running", "service_unavailable")
        return {"status": "ok"}

    @app.get("/ping", tags=["health"])
    async def ping():
        return PlainTextResponse("pong")

    @app.get("/engine_check", tags=["health"])
    async def engine_check():
        """The engine loop answers between steps (a round trip through its thread)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(engine.call, lambda: True, 10.0), 15.0)
        except Exception as e:
            raise APIError(503, f"engine check failed: {e}", "service_unavailable") from None
        return {"status": "ok", "engine": "alive"}

    @app.get("/metrics", dependencies=auth, tags=["health"])
    async def metrics():
        stats: dict = {}
        if engine.is_alive:
            try:
                stats = await asyncio.wait_for(asyncio.to_thread(engine.stats), 15.0)
            except Exception:
                stats = {}
        return PlainTextResponse(
            server.metrics.render(stats), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models", dependencies=auth)
    async def models():
        base = {
            "id": settings.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "lmengine",
            "root": settings.model_name,
            "parent": None,
            "max_model_len": server.session_len,
        }
        adapters = [
            {**base, "id": name, "root": name, "parent": settings.model_name}
            for name in (engine.engine_config.adapters or {})
        ]
        return {"object": "list", "data": [base, *adapters]}

    # ---- completions --------------------------------------------------------------------------
    async def completions(body: CompletionRequest, request: Request, endpoint: str):
        adapter = server.adapter_for(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (or be left out)", param="best_of")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = list(prompt) or [[]]
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} prompts x n per request", param="n")
        ids = [server.encode_text(p) if isinstance(p, str) else list(p) for p in prompts]
        configs = _gen_configs(body, len(ids), body.max_tokens, body.logprobs, server.session_len)
        job = server.new_job(endpoint)
        server.check_queue(len(configs))
        job.submit(
            [p for p in ids for _ in range(body.n)],
            configs,
            adapter,
            body.priority,
            body.user_id or body.user,
        )
        echo = [p if isinstance(p, str) else None for p in prompts]
        return await run_job(
            job,
            request,
            body,
            lambda: complete_nonstream(job, body, echo),
            lambda: complete_stream(job, body, echo),
        )

    def echo_texts(job: Job, body: CompletionRequest, echo: list[str | None]) -> list[str]:
        """The prompts as text (token-id prompts decoded once the engine accepted them)."""
        ids = [c.input_ids for c in job.choices[:: body.n]]
        return [e if e is not None else server.tokenizer.decode(i) for e, i in zip(echo, ids)]

    def complete_nonstream(job: Job, body: CompletionRequest, echo: list[str | None]) -> dict:
        if body.echo:
            echo = echo_texts(job, body, echo)
        choices = []
        for i, c in enumerate(job.choices):
            resp = c.final
            text = resp.text or ""
            if body.echo:
                text = echo[i // body.n] + text
            logprobs = None
            if body.logprobs is not None:
                logprobs, _ = server.completion_logprobs(resp, 0, body.logprobs, 0)
            choices.append(
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": _finish(resp)}
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or settings.model_name,
            "choices": choices,
            "usage": server.usage(job, body.n),
        }

    async def complete_stream(job: Job, body: CompletionRequest, echo: list[str]):
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = body.model or settings.model_name
        sent_text = [0] * len(job.choices)
        sent_tokens = [0] * len(job.choices)
        offsets = [0] * len(job.choices)
        if body.echo:
            echo = echo_texts(job, body, echo)
            for i in range(len(job.choices)):
                yield _sse(chunk(rid, created, model, "text_completion", i, text=echo[i // body.n]))
        async for i, resp in job.responses():
            text = resp.text or ""
            delta = text[sent_text[i] :]
            logprobs = None
            if body.logprobs is not None:
                logprobs, offsets[i] = server.completion_logprobs(
                    resp, sent_tokens[i], body.logprobs, offsets[i]
                )
            sent_text[i], sent_tokens[i] = len(text), len(resp.token_ids)
            if resp.finish_reason == "error":
                yield _sse(APIError(500, resp.error or "generation failed", "server_error").body())
                continue
            if delta or resp.finish_reason or logprobs:
                yield _sse(
                    chunk(
                        rid,
                        created,
                        model,
                        "text_completion",
                        i,
                        text=delta,
                        logprobs=logprobs,
                        finish_reason=_finish(resp),
                    )
                )
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(
                usage_chunk(rid, created, model, "text_completion", server.usage(job, body.n))
            )
        yield "data: [DONE]\n\n"

    def chunk(
        rid, created, model, obj, index, text=None, delta=None, logprobs=None, finish_reason=None
    ):
        choice: dict = {"index": index}
        if delta is not None:
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}

    def usage_chunk(rid, created, model, obj, usage):
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage,
        }

    # ---- chat completions ---------------------------------------------------------------------
    async def chat_completions(body: ChatCompletionRequest, request: Request, endpoint: str):
        adapter = server.adapter_for(body.model)
        messages = [{"role": m.role, "content": _text_of(m)} for m in body.messages]
        ids = server.encode_chat(messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_top = body.top_logprobs or 0
        logprobs = num_top if body.logprobs else None
        configs = _gen_configs(body, 1, max_tokens, logprobs, server.session_len)
        if max_tokens is None:  # NOTE: no limit asked: up to the end of the context
            for cfg in configs:
                cfg.max_new_tokens = max(1, server.session_len - len(ids))
                cfg.min_new_tokens = min(cfg.min_new_tokens, cfg.max_new_tokens)
        job = server.new_job(endpoint)
        server.check_queue(len(configs))
        job.submit([ids] * body.n, configs, adapter, body.priority, body.user_id or body.user)
        return await run_job(
            job,
            request,
            body,
            lambda: chat_nonstream(job, body, num_top),
            lambda: chat_stream(job, body, num_top),
        )

    def chat_nonstream(job: Job, body: ChatCompletionRequest, num_top: int) -> dict:
        choices = []
        for i, c in enumerate(job.choices):
            resp = c.final
            logprobs = None
            if body.logprobs:
                logprobs = {"content": server.chat_logprobs(resp, 0, num_top)}
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": resp.text or ""},
                    "logprobs": logprobs,
                    "finish_reason": _finish(resp),
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or settings.model_name,
            "choices": choices,
            "usage": server.usage(job, body.n),
        }

    async def chat_stream(job: Job, body: ChatCompletionRequest, num_top: int):
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model, obj = body.model or settings.model_name, "chat.completion.chunk"
        sent_text = [0] * len(job.choices)
        sent_tokens = [0] * len(job.choices)
        for i in range(len(job.choices)):
            yield _sse(
                chunk(rid, created, model, obj, i, delta={"role": "assistant", "content": ""})
            )
        async for i, resp in job.responses():
            text = resp.text or ""
            delta = text[sent_text[i] :]
            logprobs = None
            if body.logprobs:
                logprobs = {"content": server.chat_logprobs(resp, sent_tokens[i], num_top)}
            sent_text[i], sent_tokens[i] = len(text), len(resp.token_ids)
            if resp.finish_reason == "error":
                yield _sse(APIError(500, resp.error or "generation failed", "server_error").body())
                continue
            if delta or resp.finish_reason or (logprobs and logprobs["content"]):
                yield _sse(
                    chunk(
                        rid,
                        created,
                        model,
                        obj,
                        i,
                        delta={"content": delta} if delta else {},
                        logprobs=logprobs,
                        finish_reason=_finish(resp),
                    )
                )
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(usage_chunk(rid, created, model, obj, server.usage(job, body.n)))
        yield "data: [DONE]\n\n"

    # ---- running a job ------------------------------------------------------------------------
    async def run_job(
        job: Job, request: Request, body, nonstream, stream, media="text/event-stream"
    ):
        """Wait for the job's first response (so a refusal is a 4xx, not a broken stream),
        then answer whole or stream; a client that leaves cancels the job."""
        watcher = asyncio.create_task(job.watch_disconnect(request))
        try:
            await job.wait_started()
            if not body.stream:
                async for _ in job.responses():
                    pass
                failed = [c.final for c in job.choices if c.final.finish_reason == "error"]
                if failed:  # failed while generating (the engine died or closed)
                    err = engine_error(failed[0].error or "generation failed")
                    if err.status == 400:
                        err = APIError(500, err.message, "server_error")
                    raise err
                return nonstream()
        except BaseException:
            job.cancel("failed")
            raise
        finally:
            watcher.cancel()
        return StreamingResponse(guarded(job, stream()), media_type=media)

    async def guarded(job: Job, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """The stream's events; when the stream ends early (client gone: the task is
        cancelled, or the generator closed) the job is cancelled and its blocks freed."""
        try:
            async for event in events:
                yield event
        except APIError as err:
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            if not job.is_done:
                job.cancel("client disconnected")

    @app.post("/v1/completions", dependencies=auth)
    async def v1_completions(body: CompletionRequest, request: Request):
        return await completions(body, request, "completions")

    @app.post("/v1/chat/completions", dependencies=auth)
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat_completions(body, request, "chat_completions")

    # ---- LMDeploy's QoS endpoints -------------------------------------------------------------
    if not settings.qos_enabled:

        async def qos_off(request: Request):
            raise APIError(
                404, "QoS is off: start the server with --qos-config-path", code="not_found"
            )

        for path in ("/v1/completions_qos", "/v1/chat/completions_qos", "/v1/chat/interactive_qos"):
            app.add_api_route(path, qos_off, methods=["POST"], include_in_schema=False)
        return app

    @app.post("/v1/completions_qos", dependencies=auth, tags=["qos"])
    async def v1_completions_qos(body: CompletionRequestQos, request: Request):
        return await completions(body, request, "completions_qos")

    @app.post("/v1/chat/completions_qos", dependencies=auth, tags=["qos"])
    async def v1_chat_completions_qos(body: ChatCompletionRequestQos, request: Request):
        return await chat_completions(body, request, "chat_completions_qos")

    @app.post("/v1/chat/interactive_qos", dependencies=auth, tags=["qos"])
    async def v1_chat_interactive_qos(body: InteractiveRequestQos, request: Request):
        """One turn of a chat session. NOTE: the engine does not keep KV between requests yet,
        so the server keeps each session's messages and sends the whole history every turn."""
        sid = body.session_id
        session = server.sessions.get(sid) if sid >= 0 else None
        if body.cancel:
            if session is not None and session.get("job") is not None:
                session["job"].cancel("cancelled by the client")
            server.sessions.pop(sid, None)
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
            turn = [{"role": m.role, "content": _text_of(m)} for m in body.prompt]
        messages = session["messages"] + turn
        ids = server.encode_chat(messages)
        history_tokens = session["num_tokens"]
        max_tokens = min(body.request_output_len, max(1, server.session_len - len(ids)))
        try:
            cfg = GenerationConfig(
                max_new_tokens=max_tokens,
                do_sample=body.temperature > 0,
                temperature=body.temperature if body.temperature > 0 else 1.0,
                top_k=max(body.top_k, 0),
                top_p=body.top_p,
                repetition_penalty=body.repetition_penalty,
                ignore_eos=body.ignore_eos,
                random_seed=body.seed,
                stop_words=_stop_words(body.stop),
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None
        job = server.new_job("interactive_qos")
        server.check_queue(1)
        if sid >= 0:
            session["job"] = job
            server.sessions[sid] = session
        job.submit([ids], [cfg], None, body.priority, body.user_id)

        def result(resp: Response, text: str) -> dict:
            return {
                "text": text,
                "tokens": resp.generate_token_len,
                "input_tokens": resp.input_token_len,
                "history_tokens": history_tokens,
                "finish_reason": _finish(resp),
            }

        def close_turn() -> None:
            session["job"] = None
            final = job.choices[0].final
            keep = body.interactive_mode and sid >= 0
            if keep and final is not None and final.finish_reason in ("stop", "length"):
                session["messages"] = messages + [
                    {"role": "assistant", "content": final.text or ""}
                ]
                session["num_tokens"] = final.input_token_len + final.generate_token_len
            elif not keep:
                server.sessions.pop(sid, None)

        def nonstream() -> dict:
            close_turn()
            final = job.choices[0].final
            return result(final, final.text or "")

        async def stream():
            sent = 0
            try:
                async for _, resp in job.responses():
                    text = resp.text or ""
                    yield json.dumps(result(resp, text[sent:]), ensure_ascii=False) + "\n"
                    sent = len(text)
            finally:
                close_turn()

        try:
            return await run_job(job, request, body, nonstream, stream, "application/x-ndjson")
        except BaseException:
            session["job"] = None
            if not body.interactive_mode:
                server.sessions.pop(sid, None)
            raise

    return app
