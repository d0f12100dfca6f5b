"""What slow and hostile clients cost everyone else: `/health` and a normal stream, measured
against an idle `lmengine serve` and again while hostile clients hold connections.

    python benchmarks/hostile_clients.py                     # the default model
    python benchmarks/hostile_clients.py --model M -- --max-connections 256

The hostile clients, each in its own thread and reconnecting whenever the server closes on
them (so the pressure lasts the whole phase): `--slow-header` clients that send half a
request's headers and then a byte a second, `--slow-body` clients that send a request's
headers and then its body a byte a second, and `--unread` clients that ask for a long stream
and never read it. Each phase measures `--health` sequential `/health` requests and
`--streams` sequential streamed chat completions (`--max-tokens` tokens, EOS ignored): the
50th and 99th percentile of /health's latency, and of the streams' time to first token and
gaps between tokens. The machine must be idle first (`--force` runs anyway). Prints a table
and writes `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import start_server, stop  # noqa: E402
from lmengine.bench.report import check_idle, command_line, cpu_model, nearest_rank  # noqa: E402
from lmengine.bench.soak import httpx  # noqa: E402

NAME = "hostile"


def body(max_tokens: int, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": NAME,
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


def head(length: int) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


class Hostile(threading.Thread):
    """One hostile client, reconnecting until `stop` is set; counts its connections."""

    def __init__(self, kind: str, port: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.kind, self.port, self.stop_event = kind, port, stop
        self.connections = 0

    def run(self) -> None:
        while not self.stop_event.is_set():
            with contextlib.suppress(OSError), socket.socket() as sock:
                if self.kind == "unread":  # a small window, so that the server's writes block
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", self.port))
                self.connections += 1
                if self.kind == "slow-header":
                    data, start = head(10), 0
                    sock.sendall(data[: len(data) // 2])
                    start = len(data) // 2
                elif self.kind == "slow-body":
                    payload = body(8, False)
                    sock.sendall(head(len(payload)))
                    data, start = payload, 0
                else:  # unread: a whole request, then nothing read
                    payload = body(4000, True)
                    sock.sendall(head(len(payload)) + payload)
                    self.stop_event.wait()
                    continue
                for i in range(start, len(data)):  # a byte a second until the server closes
                    if self.stop_event.wait(1.0):
                        break
                    sock.sendall(data[i : i + 1])
            self.stop_event.wait(0.1)


def measure(url: str, num_health: int, num_streams: int, max_tokens: int) -> dict:
    """/health latencies and streams' TTFT and gaps, in ms."""
    health = []
    with httpx.Client(timeout=30) as client:
        for _ in range(num_health):
            start = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            health.append(1000 * (time.perf_counter() - start))
            time.sleep(0.01)
        ttft, gaps = [], []
        for _ in range(num_streams):
            start = time.perf_counter()
            times = []
            payload = json.loads(body(max_tokens, True))
            with client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content":' in line:
                        times.append(time.perf_counter())
            ttft.append(1000 * (times[0] - start))
            gaps += [1000 * (b - a) for a, b in zip(times, times[1:])]
    return {
        f"{name} p{q}": nearest_rank(values, q)
        for name, values in (("health", health), ("TTFT", ttft), ("ITL", gaps))
        for q in (50, 99)
    } | {"health mean": statistics.fmean(health)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default=None, help="what to serve (default: the default model)")
    p.add_argument("--slow-header", type=int, default=64)
    p.add_argument("--slow-body", type=int, default=32)
    p.add_argument("--unread", type=int, default=4)
    p.add_argument("--health", type=int, default=300, help="/health requests per phase")
    p.add_argument("--streams", type=int, default=8, help="streams per phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default="hostile_clients.json")
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    p.add_argument("flags", nargs="*", help="extra `lmengine serve` flags (after --)")
    args = p.parse_args(argv)
    busy = check_idle(args.force, wait_s=0 if args.force else 120)
    proc, url = start_server(args.model, ["--served-model-name", NAME, *args.flags])
    port = int(url.rsplit(":", 1)[1])
    try:
        measure(url, 20, 1, 8)  # warm-up
        idle = measure(url, args.health, args.streams, args.max_tokens)
        stop_event = threading.Event()
        kinds = {"slow-header": args.slow_header, "slow-body": args.slow_body}
        kinds["unread"] = args.unread
        hostile = [Hostile(k, port, stop_event) for k, n in kinds.items() for _ in range(n)]
        for client in hostile:
            client.start()
        time.sleep(2.0)  # every hostile client connected and stuck
        attacked = measure(url, args.health, args.streams, args.max_tokens)
        stop_event.set()
        connections = {k: sum(c.connections for c in hostile if c.kind == k) for k in kinds}
    finally:
        stop(proc)
    rows = [(key, idle[key], attacked[key]) for key in idle]
    print(f"{cpu_model()}, {time.strftime('%Y-%m-%d')}, CPUs {busy:.0%} busy before the run")
    print("| ms | idle | hostile clients | difference |\n| --- | ---: | ---: | ---: |")
    for key, a, b in rows:
        print(f"| {key} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    print(f"hostile connections opened: {connections}")
    report = {
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "command": command_line(),
        "busy_before": busy,
        "clients": kinds,
        "connections": connections,
        "idle": idle,
        "hostile": attacked,
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
