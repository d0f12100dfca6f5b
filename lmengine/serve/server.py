"""`lmengine serve MODEL`: flags and the uvicorn process around `build_app`.

Engine flags come from `EngineConfig` through `lmengine.flags` (one flag per field);
the server adds its own (host, port, keys, limits, template). SIGTERM shuts down gracefully:
uvicorn stops accepting, running requests get `--grace-period` seconds to finish, the rest
are cancelled, the engine is closed and the process exits 0. If the engine dies instead, the
process ends its requests and exits non-zero (serve/supervise.py); slow and hostile clients
meet the limits of serve/connections.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from lmengine.flags import FlagError, add_model_flags, build_dataclass, model_load_errors
from lmengine.serve.tools import TOOL_PARSERS

# NOTE: a server budgets fewer prompt tokens per step than offline generation (4,096), as vLLM's
# server does (2,048 against its LLM's 4,096): a burst of prompts gets its first tokens in
# turns rather than all after one long step. 2,048 rather than fewer: running streams are
# stalled in fewer steps, so under a burst the 99th percentile gap between tokens stays a
# decode step's own (docs/serving_latency.md); `--max-prefill-token-num` sets it. A server
# also maps its KV pool at start (`--no-prefault-kv-cache`: at first use, as offline), and an
# idle server's first step waits for the rest of a burst arriving (`--burst-gap-ms`: requests
# less than 25 ms apart once two have come; a lone request does not wait).
SERVE_ENGINE_DEFAULTS = {
    "max_prefill_token_num": 2048,
    "prefault_kv_cache": True,
    "burst_gap_ms": 25.0,
}


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_path", nargs="?", default=None, help="the model (same as --model)", metavar="MODEL"
    )
    add_model_flags(parser, SERVE_ENGINE_DEFAULTS)
    g = parser.add_argument_group("server options")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=23333, help="port (default: 23333)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` id clients use (default: folder name)",
    )
    g.add_argument(
        "--api-keys",
        nargs="+",
        default=None,
        metavar="KEY",
        help="accept only requests with `Authorization: Bearer KEY` (health endpoints excepted)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=0,
        help="requests waiting for their first token beyond which new ones get 429 with "
        "Retry-After (each choice of n counts; default: 0 = no limit)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds after which a request is cancelled and answered 504 (default: 0 = none)",
    )
    g.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="goodput: the time-to-first-token objective; /metrics counts the finished "
        "requests that meet it (default: 0 = none)",
    )
    g.add_argument(
        "--slo-itl-ms",
        type=float,
        default=0.0,
        help="goodput: the objective for every gap between two tokens of a request "
        "(default: 0 = none)",
    )
    g.add_argument(
        "--chat-template", default=None, metavar="FILE", help="a Jinja chat template file"
    )
    g.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=sorted(TOOL_PARSERS),
        help="how tool calls are written by the model family: hermes (Qwen 2.5/3, Hermes, "
        "SmolLM2) or llama3_json (Llama 3.x) (default: hermes)",
    )
    g.add_argument(
        "--max-body-mb",
        type=float,
        default=4.0,
        help="request bodies larger than this many MiB are answered 413 before they are "
        "parsed (default: 4; 0: no limit)",
    )
    g.add_argument(
        "--enable-lora-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints, "
        "behind the API keys): adapters loaded and unloaded while serving",
    )
    g.add_argument(
        "--lora-root",
        default=None,
        metavar="DIR",
        help="with --enable-lora-updates: load adapters only from folders inside DIR "
        "(symlinks followed); others are answered 403",
    )
    g.add_argument(
        "--embedding-pooling",
        choices=("last", "mean"),
        default="last",
        help="/v1/embeddings: the final norm's output at the last token (vLLM's default for "
        "a causal LM) or its mean over the input, L2-normalized (default: last)",
    )
    g.add_argument(
        "--no-auto-tool-constraint",
        dest="auto_tool_constraint",
        action="store_false",
        help="under tool_choice=auto, leave generation free (by default a call the model "
        "starts is constrained to the tools' schemas, so it always parses)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request's headers may take from its first byte (a new connection's "
        "first request: from the connection's opening); slower ones are answered 408 and "
        "the connection closed (default: 10; 0: none)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request's whole body may take to arrive after its headers, else 408 "
        "and the connection closed (default: 30, a 4 MiB body at 1.1 Mbit/s; 0: none)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections beyond which a new connection's request is answered 503 with "
        "Retry-After and the connection closed (default: 1024; 0: no limit)",
    )
    g.add_argument(
        "--stream-write-timeout",
        type=float,
        default=60.0,
        help="seconds an answer (a stream) may wait on a client that reads nothing once the "
        "socket's buffers are full; then the connection is dropped and the request "
        "cancelled, its KV blocks freed (default: 60; 0: none)",
    )
    g.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish before they are cancelled",
    )
    g.add_argument("--log-level", default="warning", help="uvicorn log level (default: warning)")


def _model_name(path: str | None) -> str:
    if path is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(path)) or path


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        print(
            "lmengine serve needs the serve extra: pip install 'lmengine[serve]'", file=sys.stderr
        )
        return 2
    from lmengine.config import EngineConfig
    from lmengine.engine.engine import Engine
    from lmengine.engine.fault_injection import inject_loop_death
    from lmengine.serve.app import ServerSettings, build_app
    from lmengine.serve.connections import ConnectionLimits, guarded_protocol
    from lmengine.serve.limits import too_many_connections
    from lmengine.serve.supervise import EngineWatch

    model = args.model_path or args.model
    engine_config = build_dataclass(EngineConfig, args, SERVE_ENGINE_DEFAULTS)
    template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.max_body_mb < 0:
        raise ValueError(f"--max-body-mb must be >= 0, got {args.max_body_mb}")
    for flag in ("request_timeout", "header_timeout", "body_timeout", "max_connections",
                 "stream_write_timeout"):  # fmt: skip
        if getattr(args, flag) < 0:
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} must be >= 0 (0: none), got {getattr(args, flag)}")
    lora_root = None
    if args.lora_root is not None:
        if not args.enable_lora_updates:
            raise FlagError(
                "--lora-root confines runtime adapter loads: it needs --enable-lora-updates"
            )
        lora_root = os.path.realpath(args.lora_root)
    settings = ServerSettings(
        model_name=args.served_model_name or _model_name(model),
        api_keys=list(args.api_keys or []),
        max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout,
        slo_ttft_s=args.slo_ttft_ms / 1000,
        slo_itl_s=args.slo_itl_ms / 1000,
        chat_template=template,
        tool_call_parser=args.tool_call_parser,
        auto_tool_constraint=args.auto_tool_constraint,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        body_timeout=args.body_timeout,
        qos_enabled=engine_config.qos_config_path is not None,
        enable_lora_updates=args.enable_lora_updates,
        lora_root=lora_root,
        embedding_pooling=args.embedding_pooling,
    )
    limits = ConnectionLimits(args.header_timeout, args.max_connections, args.stream_write_timeout)
    with model_load_errors(model, engine_config):
        engine = Engine.from_pretrained(model, engine_config)
    inject_loop_death(engine)
    app = build_app(engine, settings)
    client = app.state.client
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.grace_period,
        access_log=False,
        # NOTE: h11, whatever else is installed: the limits are built on its protocol. No
        # WebSocket (no route has one): an upgraded connection would leave the protocol, its
        # timers and its count behind
        http=guarded_protocol(limits, too_many_connections(limits.max_connections, client.metrics)),
        ws="none",
    )
    server = _Server(config)
    client.is_shutting_down = lambda: server.should_exit
    server.end_requests = client.end_requests
    server.watch = EngineWatch(engine, client.end_requests)
    logging.getLogger("lmengine").info("serving %s on %s:%d", model, args.host, args.port)
    print(
        f"lmengine serve: http://{args.host}:{args.port} (model {settings.model_name})", flush=True
    )
    server.run()
    engine.close()
    if server.exit_code:  # crash-only: no interpreter teardown (~2 s with torch) to wait for
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return 0


def _make_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGTERM ends the process with 0 after the graceful
        shutdown (uvicorn re-raises the signal, which would kill it with -15), and that the
        death of the engine ends it with EXIT_ENGINE_FAILED (`watch`, crash-only)."""

        end_requests = staticmethod(lambda reason: None)  # the app's: ends every request
        watch = None  # an EngineWatch, checked on every tick
        exit_code = 0
        crashed_at: float | None = None  # when the engine was found dead (time.monotonic())

        async def on_tick(self, counter: int) -> bool:
            if not self.should_exit and self.watch is not None:
                self._crash_only()
            return await super().on_tick(counter)

        def _crash_only(self) -> None:
            """Once the engine is dead: answer 503 (its requests ended, /health too) for
            CRASH_LINGER_S, then shut down briefly and exit with EXIT_ENGINE_FAILED."""
            from lmengine.serve.supervise import CRASH_GRACE_S, CRASH_LINGER_S, EXIT_ENGINE_FAILED

            now = time.monotonic()
            if self.crashed_at is None:
                if self.watch.check() is not None:
                    self.crashed_at, self.exit_code = now, EXIT_ENGINE_FAILED
            elif now > self.crashed_at + CRASH_LINGER_S:
                grace = self.config.timeout_graceful_shutdown
                if grace is None or grace > CRASH_GRACE_S:
                    self.config.timeout_graceful_shutdown = CRASH_GRACE_S
                self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            """uvicorn's graceful shutdown; shortly before the grace period ends (when uvicorn
            would cancel the handlers and cut their streams) every request still running is
            ended with a 503 error its client can read (an error event and [DONE] for a
            stream)."""
            grace = self.config.timeout_graceful_shutdown
            if grace is not None:
                margin = min(1.0, grace / 2)
                loop = asyncio.get_running_loop()
                loop.call_later(grace - margin, self.end_requests, "server shutdown")
            await super().shutdown(sockets)

        def handle_exit(self, sig: int, frame) -> None:
            if sig == signal.SIGTERM:
                self.should_exit = True
                return
            super().handle_exit(sig, frame)

    return Server


def _Server(config):  # noqa: N802 - a class factory: uvicorn is imported only when serving
    return _make_server_class()(config)
