"""What every router shares (`ServerContext`): the engine, the settings, the response router,
the metrics, the interactive sessions, and the helpers that turn text into token ids and
admit a request (adapter lookup, queue limit, shutdown) through the engine's client."""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lmengine.config import GenerationConfig
from lmengine.engine.request import RequestError, Response
from lmengine.serve.errors import APIError, engine_error
from lmengine.serve.jobs import Job, ResponseRouter
from lmengine.serve.limits import arrived_callback, received_at
from lmengine.serve.logprobs import TokenTexts
from lmengine.serve.metrics import ServerMetrics
from lmengine.serve.settings import ServerSettings

NUM_TOKENIZING_THREADS = 2
# interactive QoS sessions kept (their chat histories); past it the least recently used idle
# one is forgotten (its next turn starts a new history), so session ids from clients cannot
# grow the server's memory without end
MAX_INTERACTIVE_SESSIONS = 1024


class ServerContext:
    """What the routes share: one Engine (started by the caller, closed at app shutdown), its
    tokenizer, the server metrics and the chat sessions of the interactive QoS endpoint.

    It admits requests and builds their `Job`s through the engine's front door
    (`engine.client`); it never touches the engine's parts (the engine thread owns those) and
    holds no per-request state besides the sessions.
    """

    def __init__(self, engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.session_len: int = engine.session_len
        self.metrics = ServerMetrics(settings.slo_ttft_s, settings.slo_itl_s)
        engine.add_observer(self.metrics.observe_step)
        self.router: ResponseRouter | None = None  # built on the event loop at startup
        # interactive session id -> history, least recently used first (`keep_session`)
        self.sessions: OrderedDict[int, dict] = OrderedDict()
        self.created = int(time.time())
        self.is_shutting_down: Callable[[], bool] = lambda: False
        self.token_text = TokenTexts(self.tokenizer)
        self.metrics.track("interactive_sessions", lambda: len(self.sessions))
        self.metrics.track("token_texts", lambda: len(self.token_text))
        self.metrics.track("jobs", lambda: len(self.router.jobs) if self.router else 0)
        # NOTE: each tokenizing thread has its own copy of the tokenizer (a fast tokenizer
        # is not safe for concurrent use); two, so one large request does not hold up others.
        # The copies are made here, at start: the pool starts its second thread only when two
        # requests are tokenized at once, i.e. in the first burst, whose requests and first
        # step would otherwise wait for the copy (115-125 ms of Python holding the GIL for
        # SmolLM2's tokenizer; Intel Xeon, 2026-12-04)
        self._local = threading.local()
        self._spare_tokenizers = [
            copy.deepcopy(self.tokenizer) for _ in range(NUM_TOKENIZING_THREADS)
        ]
        self._tokenizing = ThreadPoolExecutor(
            NUM_TOKENIZING_THREADS, "lmengine-tokenize", initializer=self._own_tokenizer
        )

    # ---- models -------------------------------------------------------------------------------
    def adapter_names(self) -> list[str]:
        """The LoRA adapters the engine serves now (added and removed ones included)."""
        return list(self.engine.adapter_names)

    def adapter_for(self, model: str | None) -> str | None:
        """The adapter a `model` field names (None: the base model); 404 when unknown."""
        if model is None or model == self.settings.model_name:
            return None
        if model in self.adapter_names():
            return model
        raise APIError(
            404, f"the model {model!r} does not exist", "invalid_request_error", "model_not_found"
        )

    def keep_session(self, session_id: int, session: dict) -> None:
        """Keep an interactive session as the most recently used; forget the least recently
        used idle ones past MAX_INTERACTIVE_SESSIONS (a session with a running turn stays)."""
        self.sessions[session_id] = session
        self.sessions.move_to_end(session_id)
        if len(self.sessions) <= MAX_INTERACTIVE_SESSIONS:
            return
        idle = [sid for sid, s in self.sessions.items() if s.get("job") is None]
        for sid in idle[: len(self.sessions) - MAX_INTERACTIVE_SESSIONS]:
            del self.sessions[sid]

    # ---- text -> token ids --------------------------------------------------------------------
    def _own_tokenizer(self) -> None:
        # NOTE: list.pop is atomic, and the pool starts at most NUM_TOKENIZING_THREADS threads,
        # each living as long as the pool: one spare each
        self._local.tokenizer = self._spare_tokenizers.pop()

    def local_tokenizer(self):
        """The tokenizer of the calling tokenizing thread (the shared one elsewhere)."""
        return getattr(self._local, "tokenizer", self.tokenizer)

    async def off_loop(self, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` in the tokenizing thread: templating and tokenizing a
        large request never delay another request's tokens or /health."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, functools.partial(fn, *args, **kwargs))

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.local_tokenizer()(text, add_special_tokens=add_special_tokens)["input_ids"]
        return list(ids)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> list[int]:
        template = self.settings.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template: use /v1/completions")
        try:
            ids = self.local_tokenizer().apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                tokenize=True,
                return_dict=False,
            )
        except Exception as e:  # a template that refuses these messages (roles, order)
            raise APIError(400, f"chat template failed on these messages: {e}") from None
        return list(ids)

    # ---- admission ----------------------------------------------------------------------------
    def check_engine(self) -> None:
        """503 when the server is shutting down or the engine is gone."""
        if self.is_shutting_down():
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", "service_unavailable")

    def new_job(self, endpoint: str, request) -> Job:
        """An empty Job for the HTTP `request`; 503 when shutting down or the engine is gone."""
        self.check_engine()
        return Job(
            self.engine.client,
            self.router,
            self.metrics,
            endpoint,
            self.settings.request_timeout or None,
            received_at(request),
            arrived_callback(request),
        )

    def submit(
        self,
        job: Job,
        prompts: list[list[int]],
        configs: list[GenerationConfig],
        adapter: str | None,
        priority: int | None,
        user: str | None,
    ) -> None:
        """Submit one engine request per choice (prompt i's token ids for configs i): 400 for
        a request that can never run, checked before the queue (429), so that a client only
        retries what can succeed."""
        door = self.engine.client
        requests = []
        for i, (ids, cfg) in enumerate(zip(prompts, configs)):
            wanted = len(ids) + cfg.max_new_tokens
            if ids and (wanted > self.session_len or len(ids) >= self.session_len):
                raise APIError(
                    400,
                    f"this model's context is {self.session_len} tokens, the request needs "
                    f"{wanted} ({len(ids)} in the prompt, {cfg.max_new_tokens} to generate): "
                    "shorten the prompt or lower max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            req = door.request(
                ids,
                cfg,
                response_queue=self.router,
                index=i,
                adapter_name=adapter,
                priority=priority,
                user_id=user,
            )
            try:
                door.check(req)  # NOTE: once: the engine takes a checked request as it is
            except RequestError as e:
                raise engine_error(str(e)) from None
            requests.append(req)
        self.check_queue(len(requests))
        job.submit(requests)

    def check_queue(self, num_choices: int) -> None:
        """429 with Retry-After when `num_choices` more would pass `--max-queued-requests`
        now; 400 when they are more than it allows at all."""
        limit = self.settings.max_queued_requests
        if limit and num_choices > limit:
            raise APIError(
                400,
                f"the request has {num_choices} choices (prompts x n), more than the server "
                f"queues at once ({limit}): split it",
                param="n",
            )
        if limit and self.metrics.num_queued + num_choices > limit:
            raise APIError(
                429,
                f"too many queued requests ({self.metrics.num_queued} waiting, limit {limit})",
                "rate_limit_exceeded",
                "too_many_requests",
                headers={"Retry-After": "1"},
            )

    def close(self) -> None:
        self.engine.remove_observer(self.metrics.observe_step)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    def end_requests(self, reason: str) -> None:
        """Cancel every running request (the event loop): each answers 503 (`Job.cancel`)."""
        if self.router is not None:
            for job in {id(j): j for j in self.router.jobs.values()}.values():
                job.cancel(reason)

    # ---- answers ------------------------------------------------------------------------------
    def model_name(self, body) -> str:
        """The `model` of an answer: the one asked for, else the served name."""
        return body.model or self.settings.model_name

    @staticmethod
    def usage(job: Job, n: int) -> dict:
        """Prompt tokens counted once per prompt (choices i * n), as OpenAI does."""
        finals = [c.final or Response() for c in job.choices]
        prompt = sum(r.input_token_len for r in finals[::n])
        completion = sum(r.generate_token_len for r in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
