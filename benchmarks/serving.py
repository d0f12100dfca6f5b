"""Serving benchmark: a load generator over HTTP against `lmengine serve`, and the same load on
the in-process API (EngineInstance.stream_infer), in one run, to show the server's overhead.

    python benchmarks/serving.py                          # fixed concurrency 32, SmolLM2
    python benchmarks/serving.py --request-rate 2 4       # Poisson arrivals at 2 and 4 req/s
    python benchmarks/serving.py --quick                  # a smoke test with small sizes
    python benchmarks/serving.py --router                 # one replica direct vs behind smg

Every request is a chat prompt of examples/prompts.txt with `--max-tokens` new tokens (EOS
ignored, greedy), so both sides do exactly the same work. Reported per run: request and
output-token throughput, time to first token (TTFT), time per output token after the first
(TPOT), inter-token latency (ITL), end-to-end latency (p50/p90/p99), and goodput: requests
per second that met the latency targets (--slo-ttft-ms, --slo-tpot-ms). The in-process side
runs first, then the server is started as a subprocess with the same engine flags. With
`--router`, there is no in-process run: one server is measured directly and behind SGLang's
model gateway (`smg`, round robin over that one replica), the two alternating, twice each, to
show what the router adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "examples" / "prompts.txt"


@dataclass
class Sample:
    """One request as the client saw it (seconds since its send)."""

    ttft: float = float("nan")
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk
    num_tokens: int = 0
    e2e: float = float("nan")
    ok: bool = False


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(name: str, samples: list[Sample], wall: float, slo_ttft: float, slo_tpot: float):
    ok = [s for s in samples if s.ok]
    tpot = [(s.e2e - s.ttft) / (s.num_tokens - 1) for s in ok if s.num_tokens > 1]
    itl = [b - a for s in ok for a, b in zip(s.token_times, s.token_times[1:])]
    good = [
        s
        for s in ok
        if s.ttft <= slo_ttft
        and (s.num_tokens <= 1 or (s.e2e - s.ttft) / (s.num_tokens - 1) <= slo_tpot)
    ]
    out_tokens = sum(s.num_tokens for s in ok)
    row = {
        "name": name,
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "wall_s": wall,
        "req_per_s": len(ok) / wall,
        "out_tok_per_s": out_tokens / wall,
        "goodput_req_per_s": len(good) / wall,
    }
    for key, values in (("ttft", [s.ttft for s in ok]), ("tpot", tpot), ("itl", itl),
                        ("e2e", [s.e2e for s in ok])):  # fmt: skip
        for q in (50, 90, 99):
            row[f"{key}_p{q}_ms"] = percentile(values, q) * 1000
    return row


# ---- arrivals -----------------------------------------------------------------------------------
def arrival_offsets(num: int, rate: float | None, seed: int) -> list[float] | None:
    """Poisson arrivals (exponential gaps) at `rate` req/s; None for fixed concurrency."""
    if rate is None:
        return None
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- the in-process API -------------------------------------------------------------------------
def run_inprocess(engine, prompts, max_tokens, concurrency, offsets) -> tuple[list[Sample], float]:
    from lmengine import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True)
    inst = engine.create_instance()
    samples = [Sample() for _ in prompts]

    def one(i: int) -> None:
        s = samples[i]
        t0 = time.perf_counter()
        last = None
        for r in inst.stream_infer(engine.new_request_id(), prompts[i], gen_config=cfg):
            now = time.perf_counter() - t0
            if r.generate_token_len and r.finish_reason != "error":
                if s.token_times == []:
                    s.ttft = now
                s.token_times.append(now)
            last = r
        s.e2e = time.perf_counter() - t0
        s.num_tokens = last.generate_token_len if last else 0
        s.ok = last is not None and last.finish_reason == "length"

    start = time.perf_counter()
    threads = []
    if offsets is None:
        todo = iter(range(len(prompts)))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                one(i)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
    else:
        for i, at in enumerate(offsets):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            t = threading.Thread(target=one, args=(i,))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    return samples, time.perf_counter() - start


# ---- HTTP ---------------------------------------------------------------------------------------
async def run_http(
    url, messages, max_tokens, concurrency, offsets, model: str | None = None
) -> tuple[list[Sample], float]:
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx

    samples = [Sample() for _ in messages]
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(i: int) -> None:
            s = samples[i]
            body = {
                "messages": messages[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                **({"model": model} if model else {}),
            }
            t0 = time.perf_counter()
            finish = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter() - t0
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        s.num_tokens = chunk["usage"]["completion_tokens"]
                    for c in chunk.get("choices", []):
                        if c.get("delta", {}).get("content"):
                            if not s.token_times:
                                s.ttft = now
                            s.token_times.append(now)
                        finish = c.get("finish_reason") or finish
            s.e2e = time.perf_counter() - t0
            s.ok = finish == "length"

        start = time.perf_counter()
        if offsets is None:
            queue = list(range(len(messages)))[::-1]

            async def worker():
                while queue:
                    await one(queue.pop())

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:

            async def later(i, at):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                await one(i)

            await asyncio.gather(*(later(i, at) for i, at in enumerate(offsets)))
        return samples, time.perf_counter() - start


def wait_ready(proc: subprocess.Popen, ready, timeout: float, failed) -> None:
    """Poll `ready()` (True once the process serves) until it holds; RuntimeError with
    `failed(why)` when `proc` exits first or `timeout` seconds pass (then it is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(failed(f"exited with {proc.returncode}"))
        if ready():
            return
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(failed(f"did not start within {timeout:g} s"))


def http_ok(url: str, check=None) -> bool:
    """GET `url` answers 200 (and `check(json)` holds, when given); False on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200 and (check is None or check(json.loads(r.read())))
    except (OSError, ValueError):
        return False


def start_server(
    model: str | None,
    engine_flags: list[str],
    log_path: str | Path | None = None,
    port: int = 0,
    timeout: float = 300,
) -> tuple[subprocess.Popen, str]:
    """`python -m lmengine serve [MODEL]` on `port` (0: a free one), its output into
    `log_path` (default: a temporary file, never a pipe that a long run could fill); returns
    once /health answers 200, else RuntimeError with the log's tail."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "lmengine", "serve", *([model] if model else [])]
    cmd += ["--port", str(port), *engine_flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def failed(why: str) -> str:
        log.seek(0)
        return f"lmengine serve {why}: {log.read()[-2000:]}"

    wait_ready(proc, lambda: http_ok(url + "/health"), timeout, failed)
    return proc, url


def start_smg(workers: list[str], policy: str = "round_robin") -> tuple[subprocess.Popen, str]:
    """SGLang's model gateway (`smg launch`, pip install smg) on loopback in front of
    `workers`, noticing a dead worker within seconds; returns once all are healthy."""
    found = Path(sys.executable).with_name("smg")
    binary = str(found) if found.exists() else shutil.which("smg")
    if binary is None:
        raise RuntimeError("the router needs smg: pip install smg==1.13.0")
    port, prometheus = free_port(), free_port()
    cmd = [
        binary, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus),
        "--disable-tokenizer-autoload", "--log-level", "warn",
        "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
        "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def all_healthy(body) -> bool:
        return body.get("healthy_workers") == len(workers)

    wait_ready(proc, lambda: http_ok(url + "/readiness", all_healthy), 60, lambda why: f"smg {why}")
    return proc, url


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def compare_inprocess(args, engine_flags, messages, max_tokens, loads, slo_s):
    """Each load in-process (EngineInstance.stream_infer) and then over HTTP."""
    from lmengine import Engine, EngineConfig
    from lmengine.api import chat_token_ids
    from lmengine.serve.server import SERVE_ENGINE_DEFAULTS

    num = len(messages)
    rows = []
    print(f"in-process: loading {args.model or 'the default model'}", file=sys.stderr)
    engine = Engine.from_pretrained(
        args.model,
        EngineConfig(  # the server's own defaults, so both sides schedule alike
            **SERVE_ENGINE_DEFAULTS,
            max_batch_size=args.max_batch_size,
            num_threads=args.num_threads,
        ),
    )
    try:
        prompts = [chat_token_ids(engine.tokenizer, m) for m in messages]
        run_inprocess(engine, prompts[:4], 4, 4, None)  # warm-up
        for kind, value in loads:
            offsets = arrival_offsets(num, value, args.seed) if kind == "rate" else None
            conc = int(value) if kind == "concurrency" else num
            samples, wall = run_inprocess(engine, prompts, max_tokens, conc, offsets)
            rows.append(summarize(f"in-process {kind}={value}", samples, wall, *slo_s))
            print(f"  {rows[-1]['name']}: {rows[-1]['out_tok_per_s']:.1f} tok/s", file=sys.stderr)
    finally:
        engine.close()
    del engine

    print("HTTP: starting lmengine serve", file=sys.stderr)
    proc, url = start_server(args.model, engine_flags)
    try:
        asyncio.run(run_http(url, messages[:4], 4, 4, None))  # warm-up
        for kind, value in loads:
            offsets = arrival_offsets(num, value, args.seed) if kind == "rate" else None
            conc = int(value) if kind == "concurrency" else num
            samples, wall = asyncio.run(run_http(url, messages, max_tokens, conc, offsets))
            rows.append(summarize(f"HTTP {kind}={value}", samples, wall, *slo_s))
            print(f"  {rows[-1]['name']}: {rows[-1]['out_tok_per_s']:.1f} tok/s", file=sys.stderr)
    finally:
        stop(proc)
    half = len(rows) // 2
    return rows, [(a, b, "HTTP / in-process") for a, b in zip(rows[:half], rows[half:])]


def compare_router(model_path, engine_flags, messages, max_tokens, loads, slo_s, seed, repeats=2):
    """Each load against one server directly and through smg, alternating, `repeats` times."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx

    num = len(messages)
    proc, direct = start_server(model_path, engine_flags)
    router = None
    try:
        model = httpx.get(direct + "/v1/models").json()["data"][0]["id"]
        router, routed = start_smg([direct])
        for url in (direct, routed):  # warm-up
            asyncio.run(run_http(url, messages[:4], 4, 4, None, model))
        rows, pairs = [], []
        for kind, value in loads:
            offsets = arrival_offsets(num, value, seed) if kind == "rate" else None
            conc = int(value) if kind == "concurrency" else num
            for rep in range(repeats):
                pair = []
                for name, url in (("direct", direct), ("via smg", routed)):
                    run = run_http(url, messages, max_tokens, conc, offsets, model)
                    samples, wall = asyncio.run(run)
                    pair.append(
                        summarize(f"{name} {kind}={value} #{rep + 1}", samples, wall, *slo_s)
                    )
                    print(f"  {pair[-1]['name']}: {pair[-1]['out_tok_per_s']:.1f} tok/s",
                          file=sys.stderr)  # fmt: skip
                rows += pair
                pairs.append((*pair, "router / direct"))
        return rows, pairs
    finally:
        if router is not None:
            stop(router)
        stop(proc)


# ---- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/serving.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (default 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens each (default 64)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="fixed numbers of requests in flight (default: 32)")  # fmt: skip
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="Poisson arrival rates in req/s (each its own run)")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput target for TTFT")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput target for TPOT")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=0, help="engine torch threads (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--quick", action="store_true", help="16 prompts x 16 tokens, concurrency 8")
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    p.add_argument("--router", action="store_true",
                   help="one server directly vs behind smg (pip install smg)")  # fmt: skip
    args = p.parse_args(argv)
    num = args.num_prompts or (16 if args.quick else 64)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    rates = args.request_rate
    concurrencies = args.concurrency or ([] if rates else [8] if args.quick else [32])
    loads = [("concurrency", c) for c in concurrencies] + [("rate", r) for r in rates or []]
    lines = [x for x in PROMPTS.read_text(encoding="utf-8").splitlines() if x.strip()]
    messages = [[{"role": "user", "content": lines[i % len(lines)]}] for i in range(num)]
    engine_flags = ["--max-batch-size", str(args.max_batch_size),
                    "--num-threads", str(args.num_threads)]  # fmt: skip

    from lmengine.bench.report import check_idle, cpu_model

    busy = check_idle(args.force)
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, "
          f"{busy:.0%} busy at start", file=sys.stderr)  # fmt: skip
    slo_s = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    if args.router:
        rows, pairs = compare_router(
            args.model, engine_flags, messages, max_tokens, loads, slo_s, args.seed
        )
    else:
        rows, pairs = compare_inprocess(args, engine_flags, messages, max_tokens, loads, slo_s)

    slo = f"TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    print(f"\n{num} chat requests x {max_tokens} new tokens (EOS ignored, greedy); {slo}\n")
    head = ("| run | req/s | out tok/s | goodput req/s | TTFT p50/p90/p99 ms | "
            "TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | e2e p50/p90/p99 ms | failed |")  # fmt: skip
    print(head)
    print("|" + " --- |" * 9)

    def trio(r: dict, key: str) -> str:
        return "/".join(f"{r[f'{key}_p{q}_ms']:.0f}" for q in (50, 90, 99))

    for r in rows:
        lat = " | ".join(trio(r, key) for key in ("ttft", "tpot", "itl", "e2e"))
        print(f"| {r['name']} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | "
              f"{r['goodput_req_per_s']:.2f} | {lat} | {r['failed']} |")  # fmt: skip
    print()
    for base, other, what in pairs:
        ratio = other["out_tok_per_s"] / base["out_tok_per_s"]
        added = "; ".join(
            f"{key.upper()} p{q} {other[f'{key}_p{q}_ms'] - base[f'{key}_p{q}_ms']:+.1f} ms"
            for key in ("ttft", "e2e") for q in (50, 99)
        )  # fmt: skip
        print(f"{other['name']}: {what} throughput = {ratio:.3f} "
              f"({100 * (1 - ratio):+.1f} % overhead); {added}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
