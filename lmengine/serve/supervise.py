"""Crash-only serving: when the engine stops without being asked, the server does not linger.

A server whose engine is gone (its loop died, a tensor-parallel worker was killed) can only
refuse: it is better restarted. `EngineWatch.check` runs on every tick of uvicorn's main loop
(10 times a second): once the engine has stopped, every request still running is ended with a
503 (an error event and `[DONE]` for a stream; the engine has usually answered them already,
this is the backstop for one it cannot reach), `/health` answers 503 (`engine.is_alive`) and
so does every new request for `CRASH_LINGER_S` (a probe or a retry sees why), then the
server shuts down and exits with `EXIT_ENGINE_FAILED`, so that its supervisor (systemd's
`Restart=on-failure`, Kubernetes) starts a fresh one. Should the shutdown itself hang (a
process group that never tears down), the process exits anyway after `HARD_EXIT_S`.

The engine loop's death is tested in a real server process through the test hook of
lmengine/engine/fault_injection.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from lmengine.serve.errors import ENGINE_GONE

logger = logging.getLogger("lmengine.serve")

EXIT_ENGINE_FAILED = 3  # the process's exit status when the engine died under it
CRASH_LINGER_S = 1.0  # answering 503 (/health too) this long after a crash, then shut down
CRASH_GRACE_S = 2  # the graceful shutdown after a crash: the answers are out already
HARD_EXIT_S = 10.0  # a shutdown still running this long after the crash is cut short


class EngineWatch:
    """Notices the engine's death and ends what depended on it. Owns only its own failure
    reason; ending requests is the server's `end_requests`, exiting is the caller's."""

    def __init__(self, engine, end_requests: Callable[[str], None]) -> None:
        self.engine = engine
        self.end_requests = end_requests
        self.failure: str | None = None  # why the engine stopped, once it has

    def check(self) -> str | None:
        """The event loop: None while the engine runs; the first time it is found stopped,
        end every request and return why (later calls return None)."""
        if self.failure is not None or self.engine.is_alive:
            return None
        reason = self.engine.client.closed_reason or "engine loop died"
        if not reason.startswith(ENGINE_GONE):  # NOTE: so that every request gets a 503
            reason = f"engine loop died: {reason}"
        self.failure = reason
        logger.error(
            "the engine has stopped (%s): ending every request and exiting with status %d "
            "(a supervisor restarts the server)",
            reason,
            EXIT_ENGINE_FAILED,
        )
        self.end_requests(reason)
        timer = threading.Timer(HARD_EXIT_S, os._exit, (EXIT_ENGINE_FAILED,))
        timer.daemon = True
        timer.start()
        return reason
