"""Serving benchmark: a load generator over HTTP against `lmengine serve`, and the same load on
the in-process API (EngineInstance.stream_infer), in one run, to show the server's overhead.

    python benchmarks/serving.py                          # fixed concurrency 32, SmolLM2
    python benchmarks/serving.py --request-rate 2 4       # Poisson arrivals at 2 and 4 req/s
    python benchmarks/serving.py --quick                  # a smoke test with small sizes

Every request is a chat prompt of examples/prompts.txt with `--max-tokens` new tokens (EOS
ignored, greedy), so both sides do exactly the same work. Reported per run: request and
output-token throughput, time to first token (TTFT), time per output token after the first
(TPOT), inter-token latency (ITL), end-to-end latency (p50/p90/p99), and goodput: requests
per second that met the latency targets (--slo-ttft-ms, --slo-tpot-ms). The in-process side
runs first, then the server is started as a subprocess with the same engine flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
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
        for r in inst.stream_infer(engine.new_session_id(), prompts[i], gen_config=cfg):
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
async def run_http(url, messages, max_tokens, concurrency, offsets) -> tuple[list[Sample], float]:
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


def start_server(model: str | None, engine_flags: list[str]) -> tuple[subprocess.Popen, str]:
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "lmengine", "serve", *([model] if model else [])]
    cmd += ["--port", str(port), *engine_flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError("server did not start")


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

    from lmengine import Engine, EngineConfig
    from lmengine.api import chat_token_ids

    rows = []
    print(f"in-process: loading {args.model or 'the default model'}", file=sys.stderr)
    engine = Engine.from_pretrained(
        args.model,
        EngineConfig(max_batch_size=args.max_batch_size, num_threads=args.num_threads),
    )
    try:
        prompts = [chat_token_ids(engine.tokenizer, m) for m in messages]
        run_inprocess(engine, prompts[:4], 4, 4, None)  # warm-up
        for kind, value in loads:
            offsets = arrival_offsets(num, value, args.seed) if kind == "rate" else None
            conc = int(value) if kind == "concurrency" else num
            samples, wall = run_inprocess(engine, prompts, max_tokens, conc, offsets)
            rows.append(summarize(f"in-process {kind}={value}", samples, wall,
                                  args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))  # fmt: skip
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
            rows.append(summarize(f"HTTP {kind}={value}", samples, wall,
                                  args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))  # fmt: skip
            print(f"  {rows[-1]['name']}: {rows[-1]['out_tok_per_s']:.1f} tok/s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

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
    half = len(rows) // 2
    print()
    for local, http in zip(rows[:half], rows[half:]):
        ratio = http["out_tok_per_s"] / local["out_tok_per_s"]
        print(f"{http['name']}: HTTP / in-process throughput = {ratio:.3f} "
              f"(server overhead {100 * (1 - ratio):+.1f} %)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
