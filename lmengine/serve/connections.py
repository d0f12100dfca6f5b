"""Connections a slow or hostile client cannot hold: uvicorn's HTTP/1.1 protocol (h11) with a
header timeout, a bound on open connections and a write timeout.

uvicorn closes a keep-alive connection that stays idle between requests
(`timeout_keep_alive`), but it has no timer for a request that is still arriving: a client
that sends half its headers and then nothing, or one byte a minute, holds its connection
(and a file descriptor) forever. Its `limit_concurrency` refuses with a plain-text 503 only
once a request is read on a connection past the limit, counting that connection too (a
limit of N admits N - 1). And a response to a client that stops reading waits in
`send` forever once the socket's buffers are full, its job still holding KV blocks.

`guarded_protocol(limits, refuse)` is uvicorn's `H11Protocol` with three timers and a
count: the headers of a request must arrive within `header_timeout` of its first byte (of
the connection's opening, for its first request), else 408 and the connection is closed; a
connection past `max_connections` open ones gets `refuse` (an ASGI app: our JSON 503) as
the answer to its request; a write that stays blocked for `write_timeout` (the transport's
buffer over its high-water mark all that time) aborts the connection, which the app sees as
a disconnect: the request is cancelled and its KV blocks freed. The body's deadline is the
app's (`limits.BodyLimit`), where it can answer in the API's shape.

NOTE: the kernel grows a socket's send buffer up to 4 MiB (Linux's tcp_wmem), so a client
that stops reading would leave megabytes of a stream queued in the kernel before `send`
ever waits. Each connection's unsent bytes are capped at `MAX_UNSENT_BYTES`
(TCP_NOTSENT_LOWAT; bytes in flight are not, so throughput is not): a stuck reader is felt
after ~200 KB, and a thousand of them hold ~200 MB of kernel memory, not 4 GB.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("lmengine.serve")
MAX_UNSENT_BYTES = 64 << 10  # per connection, queued in the kernel and not yet sent


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may take of the server (each a `lmengine serve` flag; 0: none)."""

    header_timeout: float = 10.0  # seconds from a request's first byte to its headers' end
    max_connections: int = 1024  # open connections admitted; more are answered 503
    write_timeout: float = 60.0  # seconds a response may wait on a client that reads nothing

    def __post_init__(self) -> None:
        for name in ("header_timeout", "max_connections", "write_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: none), got {getattr(self, name)}")


def _raw_response(status: int, reason: str, body: dict) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written outside h11 (which has
    no request to answer yet)."""
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + data


HEADER_TIMEOUT_BODY = {
    "error": {
        "message": "the request's headers did not arrive in time",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }
}


def _cap_unsent_bytes(transport) -> None:
    """TCP_NOTSENT_LOWAT where the platform has it (Linux, macOS); elsewhere nothing."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or option is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, MAX_UNSENT_BYTES)
    except OSError:  # not a TCP socket (a Unix socket): nothing to cap
        pass


def guarded_protocol(limits: ConnectionLimits, refuse: Callable[..., Any]) -> type:
    """uvicorn's h11 protocol class with `limits` (one set of admitted connections per
    class: build one per server). `refuse` answers the requests of connections past
    `max_connections`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    admitted: set[asyncio.Protocol] = set()  # open connections within max_connections

    class GuardedH11Protocol(H11Protocol):
        """H11Protocol with a header timer, a write timer and the connection bound. Owns
        only its timers; requests and responses are uvicorn's as usual."""

        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            _cap_unsent_bytes(transport)
            if limits.max_connections and len(admitted) >= limits.max_connections:
                # NOTE: HTTP has no way to refuse before a request: its request is answered
                # 503 (then closed), and a refused connection counts against nobody
                self.app = refuse
            else:
                admitted.add(self)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            admitted.discard(self)
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers():  # NOTE: a request's first byte starts its clock
                self._arm_header_timer()
            super().data_received(data)
            if not self._awaiting_headers() and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def pause_writing(self) -> None:
            super().pause_writing()
            if limits.write_timeout and self._write_timer is None:
                self._write_timer = self.loop.call_later(limits.write_timeout, self._stuck_reader)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        # ---- the timers ---------------------------------------------------------------------
        def _awaiting_headers(self) -> bool:
            """No request is being answered: bytes now are the next request's headers."""
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            if limits.header_timeout and self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout, self._slow_headers)

        def _cancel_timers(self) -> None:
            for timer in (self._header_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._write_timer = None

        def _slow_headers(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._awaiting_headers():
                return
            logger.info("closed a connection whose request headers took over %.3g s",
                        limits.header_timeout)  # fmt: skip
            self.transport.write(_raw_response(408, "Request Timeout", HEADER_TIMEOUT_BODY))
            self.transport.close()
            # NOTE: close() waits for the 408 to be sent; a peer that reads nothing is cut
            self.loop.call_later(1.0, self.transport.abort)

        def _stuck_reader(self) -> None:
            self._write_timer = None
            logger.warning("dropped a connection that read nothing for %.3g s (its request "
                           "is cancelled)", limits.write_timeout)  # fmt: skip
            # NOTE: abort, not close: close() would wait to flush what the peer never reads
            self.transport.abort()

    return GuardedH11Protocol
