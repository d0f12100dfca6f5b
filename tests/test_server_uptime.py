"""Days of uptime, against a real `lmengine serve` on the tiny model: slow and hostile clients
meet their bounds (raw sockets: headers and bodies sent a byte at a time or not at all, a
stream nobody reads, one connection too many) while /health and a normal request stay fast
(within 20 ms of their idle percentiles while such clients keep coming back);
and the engine loop dying under the server (the test hook LMENGINE_TEST_LOOP_DEATH_AT_STEP)
ends every request with a 503 within seconds, turns /health to 503 and exits non-zero.
The dead tensor-parallel worker is tests/test_tp_uptime.py."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

from lmengine.bench.report import nearest_rank
from tests.test_server import httpx, metrics, server_output, start_server, stop_server, wait_idle
from tests.test_server_lifecycle import until

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
WRITE_TIMEOUT = 2.0
MAX_CONNECTIONS = 8
HEALTH_MAX_S = 0.5  # generous: the machine is shared; idle it answers in ~1 ms
CHAT = "/v1/chat/completions"


# ~1.7 KB per token (20 alternatives each): the socket's buffers (capped unsent bytes, a 4 KB
# receive window) fill after ~150 of the 900 tokens, then the send waits
UNREAD_STREAM = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 900,
    "ignore_eos": True,
    "stream": True,
    "logprobs": True,
    "top_logprobs": 20,
}


@pytest.fixture(scope="module")
def guarded(tiny_llama_path):
    proc, url = start_server(
        tiny_llama_path,
        "--num-threads", "1",
        "--block-size", "4",
        "--num-gpu-blocks", "512",
        "--header-timeout", str(HEADER_TIMEOUT),
        "--body-timeout", str(BODY_TIMEOUT),
        "--stream-write-timeout", str(WRITE_TIMEOUT),
        "--max-connections", str(MAX_CONNECTIONS),
    )  # fmt: skip
    try:
        yield proc, url
    finally:
        code = stop_server(proc)
    assert code == 0, server_output(proc)


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # NOTE: before connect, so that the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.settimeout(30)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (head and body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    length = int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    while len(data) < len(head) + 4 + length:
        data += sock.recv(4096)
    return data


def request_head(path: str, length: int, method: str = "POST") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def drip(sock: socket.socket, data: bytes, every: float, stop: threading.Event | None = None):
    """Send `data` a byte at a time until the server closes the connection (or `stop` is
    set)."""
    stop = stop or threading.Event()
    with contextlib.suppress(OSError):
        for i in range(len(data)):
            sock.sendall(data[i : i + 1])
            if stop.wait(every):
                return


class Timed(threading.Thread):
    """Runs `fn()` in a thread; `.result` and `.seconds` once joined."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.seconds = fn, None, None

    def run(self) -> None:
        start = time.monotonic()
        self.result = self.fn()
        self.seconds = time.monotonic() - start


def health_seconds(url: str, times: int = 5) -> float:
    """The slowest of `times` /health answers (each must be 200)."""
    worst = 0.0
    for _ in range(times):
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)
    return worst


def normal_request(url: str) -> tuple[int, float]:
    start = time.monotonic()
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    return r.status_code, time.monotonic() - start


def cancelled(url: str) -> float:
    """Choices that ended cancelled, over every endpoint."""
    counts = metrics(url).items()
    return sum(v for k, v in counts if k.startswith("lmengine_requests_total{") and "cancel" in k)


# ---- slow and hostile clients -------------------------------------------------------------------
def test_slow_headers_are_cut_at_the_header_timeout(guarded):
    _, guarded = guarded
    head = request_head("/v1/completions", 2)
    silent = connect(guarded)  # connects, sends nothing
    half = connect(guarded)
    half.sendall(head[:30])  # half the headers, then nothing
    dripping = connect(guarded)  # a byte every 0.1 s: the headers would take ~10 s
    Timed(lambda: drip(dripping, head + b"{}", 0.1)).start()
    readers = [Timed(lambda s=s: read_until_closed(s)) for s in (silent, half, dripping)]
    for reader in readers:
        reader.start()
    assert health_seconds(guarded) < HEALTH_MAX_S  # meanwhile
    status, seconds = normal_request(guarded)
    assert status == 200 and seconds < 10
    for reader in readers:
        reader.join(timeout=10)
        assert not reader.is_alive(), "a slow client kept its connection"
        assert HEADER_TIMEOUT * 0.9 < reader.seconds < HEADER_TIMEOUT + 3
        assert reader.result.startswith(b"HTTP/1.1 408 ")
        body = json.loads(reader.result.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"


def test_slow_body_is_cut_at_the_body_timeout(guarded):
    _, guarded = guarded
    body = json.dumps({"prompt": "x" * 200, "max_tokens": 2}).encode()
    sock = connect(guarded)
    sock.sendall(request_head("/v1/completions", len(body)) + body[:10])  # headers at once
    Timed(lambda: drip(sock, body[10:], 0.1)).start()  # the rest would take ~20 s
    reader = Timed(lambda: read_until_closed(sock))
    reader.start()
    assert health_seconds(guarded) < HEALTH_MAX_S
    reader.join(timeout=10)
    assert not reader.is_alive(), "a slow body kept its connection"
    assert BODY_TIMEOUT * 0.9 < reader.seconds < BODY_TIMEOUT + 3
    head, _, answer = reader.result.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(answer)["error"]["code"] == "request_timeout"


def test_stream_nobody_reads_is_cancelled_and_frees_its_blocks(guarded):
    proc, guarded = guarded
    data = json.dumps(UNREAD_STREAM).encode()
    before = cancelled(guarded)
    sock = connect(guarded, rcvbuf=4096)
    start = time.monotonic()
    sock.sendall(request_head(CHAT, len(data)) + data)  # and never read
    until(lambda: metrics(guarded)["lmengine_kv_blocks_used"] > 0)
    assert health_seconds(guarded) < HEALTH_MAX_S  # meanwhile
    status, seconds = normal_request(guarded)
    assert status == 200 and seconds < 10
    until(lambda: cancelled(guarded) > before, timeout=40)
    elapsed = time.monotonic() - start
    assert WRITE_TIMEOUT < elapsed < 40  # cut by the write timeout, long before 900 tokens
    m = wait_idle(guarded)
    assert m["lmengine_kv_blocks_used"] == 0 and m["lmengine_num_requests_running"] == 0
    assert "read nothing for 2 s" in server_output(proc)
    sock.settimeout(5)
    with contextlib.suppress(ConnectionResetError):  # the server dropped it
        while sock.recv(1 << 20):
            pass
    sock.close()


def test_connection_past_the_bound_gets_503(guarded):
    _, guarded = guarded
    # each held connection has had one answer and is idle in keep-alive (5 s): no header
    # timer runs on it, so the bound is what the next connection meets
    ping = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"
    held = [connect(guarded) for _ in range(MAX_CONNECTIONS)]
    for sock in held:
        sock.sendall(ping)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
    extra = connect(guarded)
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    answer = read_until_closed(extra)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower()
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    held[0].sendall(ping)  # the held ones are served as usual
    assert read_response(held[0]).startswith(b"HTTP/1.1 200 ")
    for sock in held:
        sock.close()
    until(lambda: httpx.get(guarded + "/health").status_code == 200)
    errors = metrics(guarded)
    assert errors['lmengine_http_errors_total{status="503"}'] >= 1


class Hostile:
    """Clients that come back as soon as they are cut: `slow_headers` dripping their headers,
    `slow_bodies` dripping their bodies (a byte every 0.1 s), `unread` streams never read."""

    def __init__(self, url: str, slow_headers: int, slow_bodies: int, unread: int) -> None:
        self.url, self.stopping, self.connections = url, threading.Event(), 0
        body = json.dumps({"prompt": "x" * 200, "max_tokens": 2}).encode()
        stream = json.dumps(UNREAD_STREAM).encode()
        kinds = [(b"", request_head("/v1/completions", 2) + b"{}", None)] * slow_headers
        kinds += [(request_head("/v1/completions", len(body)), body, None)] * slow_bodies
        kinds += [(request_head(CHAT, len(stream)) + stream, b"", 4096)] * unread
        self.threads = [threading.Thread(target=self.client, args=k, daemon=True) for k in kinds]

    def client(self, at_once: bytes, dripped: bytes, rcvbuf: int | None) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(OSError), connect(self.url, rcvbuf) as sock:
                self.connections += 1
                sock.sendall(at_once)
                drip(sock, dripped, 0.1, self.stopping)  # until the server cuts it
                if not dripped:  # the unread stream: held past the write timeout
                    self.stopping.wait(WRITE_TIMEOUT + 2)
            self.stopping.wait(0.05)

    def __enter__(self) -> Hostile:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=10)


def latencies(url: str, client) -> dict[str, list[float]]:
    """ms: 40 /health answers 25 ms apart, then the gaps between a normal stream's tokens."""
    health = []
    for _ in range(40):
        start = time.monotonic()
        assert client.get(url + "/health").status_code == 200
        health.append((time.monotonic() - start) * 1e3)
        time.sleep(0.025)
    body = {"prompt": "hello", "max_tokens": 48, "ignore_eos": True, "stream": True}
    arrivals = []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 40
    return {"health": health, "itl": [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]}


def test_hostile_clients_keep_health_and_a_stream_within_20_ms_of_idle(guarded):
    _, guarded = guarded
    with httpx.Client(timeout=30) as client:  # one connection, made before the hostile ones
        idle = latencies(guarded, client)
        with Hostile(guarded, slow_headers=2, slow_bodies=2, unread=1) as hostile:
            time.sleep(0.5)
            busy = latencies(guarded, client)
    assert hostile.connections >= 8  # they were cut and came back meanwhile
    for key in ("health", "itl"):
        for q in (50, 90):
            slack = nearest_rank(busy[key], q) - nearest_rank(idle[key], q)
            assert slack < 20, (key, q, sorted(idle[key]), sorted(busy[key]))
    until(lambda: metrics(guarded)["lmengine_kv_blocks_used"] == 0, timeout=30)


# ---- crash-only ---------------------------------------------------------------------------------
def run_until_the_engine_dies(url: str, kill=None) -> dict:
    """A stream and a whole request in flight; `kill()` (if given) once both run. Returns
    what each client saw and when."""
    events: list = []
    seen: dict = {"stream": events}
    long = {"prompt": "x", "max_tokens": 900, "temperature": 0, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True},
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if line:
                    events.append((time.monotonic(), line))

    def whole() -> None:
        r = httpx.post(url + "/v1/completions", json=long, timeout=60)
        seen["whole"] = (time.monotonic(), r.status_code, r.json())

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    # NOTE: the stream has its first tokens (before them, a failure is a status, not an
    # error event)
    until(lambda: len(events) >= 2, timeout=30)
    until(lambda: metrics(url)["lmengine_server_requests_in_flight"] == 2, timeout=30)
    if kill is not None:
        kill()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a request hung after the engine died"
    seen["health"] = httpx.get(url + "/health", timeout=5)
    return seen


def check_crash_answers(seen: dict, proc) -> None:
    events = seen["stream"]
    (died, last), (_, done) = events[-2], events[-1]
    assert done == "data: [DONE]"
    error = json.loads(last.removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable", error
    assert died - events[-3][0] < 5, "the stream waited long for its error"
    answered, status, body = seen["whole"]
    assert status == 503 and body["error"]["type"] == "service_unavailable", body
    assert abs(answered - died) < 5
    assert seen["health"].status_code == 503
    assert proc.wait(timeout=30) == 3, server_output(proc)


def test_engine_loop_death_ends_requests_503_and_exits_nonzero(tiny_llama_path, monkeypatch):
    # the loop dies at its 200th model step: both requests are running by then
    monkeypatch.setenv("LMENGINE_TEST_LOOP_DEATH_AT_STEP", "200")
    proc, url = start_server(tiny_llama_path, "--num-threads", "1", "--block-size", "4",
                             "--num-gpu-blocks", "512")  # fmt: skip
    try:
        seen = run_until_the_engine_dies(url)
        check_crash_answers(seen, proc)
        assert "LMENGINE_TEST_LOOP_DEATH_AT_STEP" in seen["whole"][2]["error"]["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
