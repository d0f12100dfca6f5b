"""A test hook that kills the engine loop, for tests that need it dead inside a real
`lmengine serve` process (tests/test_server_uptime.py); in-process tests patch the engine
directly (tests/test_step_faults.py).

It is read from the environment once, when the server starts: no request can reach it.
"""

from __future__ import annotations

import itertools
import logging
import os

from lmengine.engine.request import FatalEngineError

logger = logging.getLogger("lmengine")

LOOP_DEATH_ENV = "LMENGINE_TEST_LOOP_DEATH_AT_STEP"


def inject_loop_death(engine) -> None:
    """Tests only: with LMENGINE_TEST_LOOP_DEATH_AT_STEP=N in the server's environment, the
    N-th model step and every later one raise FatalEngineError, which ends the engine loop as
    a broken engine would. Read once at startup; nothing a client sends can set it."""
    value = os.environ.get(LOOP_DEATH_ENV)
    if not value:
        return
    at = int(value)
    if at < 1:
        raise ValueError(f"{LOOP_DEATH_ENV} must be a step number >= 1, got {value}")
    execute = engine.model_agent.execute
    num_calls = itertools.count(1)

    def failing_execute(inputs):
        if next(num_calls) >= at:
            raise FatalEngineError(f"injected by {LOOP_DEATH_ENV}={at}")
        return execute(inputs)

    engine.model_agent.execute = failing_execute
    logger.warning("%s=%d: the engine loop dies at model step %d (a test hook)",
                   LOOP_DEATH_ENV, at, at)  # fmt: skip
