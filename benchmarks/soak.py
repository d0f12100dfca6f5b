"""Soak `lmengine serve`: a mixed client load for a long time, watching for what grows.

    python benchmarks/soak.py --minutes 60                       # the default model
    python benchmarks/soak.py --model path/to/model --minutes 480 -- --num-gpu-blocks 2048

It starts the server (flags after `--` are passed to `lmengine serve`, after the soak's own:
`--max-queued-requests`, a QoS config, `--enable-lora-updates --lora-root` with a tiny random
LoRA adapter made with peft), runs the client mix of lmengine/bench/soak.py for a warm-up
(`--warmup-minutes`, 15: long enough for the caches bounded by size, such as oneDNN's compiled
GEMMs, to fill), lets the server go idle and takes its post-warm-up snapshot, then runs the mix
for `--minutes`, pausing every `--idle-every` minutes (10) until the server is idle and taking
its idle snapshot there too: an idle RSS that levels off from checkpoint to checkpoint is a
bounded cache filling, one that climbs steadily a leak. Every `--every` seconds it samples the
server's RSS, open file descriptors and threads (/proc/<pid>), KV blocks in use and its
bounded tables (/metrics), /health latency and the answers by status; per minute the TTFT and
inter-token latency percentiles of the streams. At the end it lets the server go idle again
and checks that every KV block is free and RSS is within `--rss-tolerance` of its post-warm-up
value.

Output: a JSON report (`--json`: CPU model, date, flags, the series, each series' drift: the
first 5 minutes against the last 5, or the first fifth against the last for runs under 25
minutes, the latency per minute, answers by operation and status, the idle checkpoints, the
final checks) and a PNG
of each series over time (`--plot`; needs matplotlib, skipped without it). The machine must be
idle before it starts (`--force` goes on anyway). Exit status 1 when any 5xx other than the
deliberate ones came back or a connection was lost, a KV block was still held once idle, or
RSS did not come back.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import start_server  # noqa: E402
from lmengine.bench.adapters import save_random_lora  # noqa: E402
from lmengine.bench.report import check_idle, command_line, cpu_model  # noqa: E402
from lmengine.bench.soak import QOS_CONFIG, Load  # noqa: E402
from lmengine.bench.soak_watch import (  # noqa: E402
    SERIES,
    Watcher,
    drift,
    drift_window,
    idle_check,
    snapshot,
    wait_idle,
)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_flags: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_flags = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2)")
    p.add_argument("--minutes", type=float, default=60.0, help="length of the soak")
    # long enough for the bounded caches that fill with traffic (oneDNN's compiled GEMMs, one
    # per row count) to be full: a SmolLM2 soak's idle RSS levels off after ~12 minutes
    p.add_argument("--warmup-minutes", type=float, default=15.0)
    p.add_argument("--workers", type=int, default=4, help="concurrent clients")
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--queue-limit", type=int, default=16, help="the server's queue limit")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per ordinary request")
    p.add_argument("--rss-tolerance", type=float, default=0.05, help="fraction, once idle")
    p.add_argument("--idle-every", type=float, default=10.0,
                   help="minutes of load between idle checkpoints (0: none)")  # fmt: skip
    p.add_argument("--json", default="soak.json", help="the report")
    p.add_argument("--plot", default="soak.png", help="the series over time ('' for none)")
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    p.add_argument("--force", action="store_true", help="run on a busy machine too")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.workers < 1 or args.every <= 0 or args.queue_limit < 1:
        p.error("--minutes, --every > 0; --workers, --queue-limit >= 1")
    return args, serve_flags


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_adapter(model: str, out: Path) -> str | None:
    """A rank-4 LoRA on q_proj and v_proj with random weights (peft starts B at zero), for
    the adapter loads; None when peft cannot make one for this model."""
    try:
        return save_random_lora(model, out, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    except Exception as e:  # no peft, no q_proj/v_proj: the soak goes on without adapters
        log(f"no adapter operations: {type(e).__name__}: {e}")
        return None


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        log("no matplotlib: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in report["series"] if "error" not in s]
    latency = report["latency_by_minute"]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, name in zip(axes.flat, SERIES):
        ax.plot([s["t"] / 60 for s in rows], [s[name] for s in rows])
        ax.set(title=name, xlabel="minutes")
    ax = axes.flat[len(SERIES)]
    for key in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p99"):
            ax.plot(
                [m["minute"] for m in latency], [m[key][q] for m in latency], label=f"{key} {q}"
            )
    ax.set(title="stream latency per minute", xlabel="minutes", yscale="log")
    ax.legend(fontsize=7)
    ax = axes.flat[len(SERIES) + 1]
    for state in sorted(rows[0]["tables"]) if rows else []:
        ax.plot([s["t"] / 60 for s in rows], [s["tables"].get(state, 0) for s in rows], label=state)
    ax.set(title="bounded tables (entries)", xlabel="minutes", yscale="symlog")
    ax.legend(fontsize=7)
    fig.suptitle(f"lmengine serve soak: {report['model']} on {report['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    log(f"wrote {path}")


def segments(minutes: float, every: float) -> list[float]:
    """The soak's minutes cut at every `every` minutes (0: in one piece)."""
    if every <= 0 or every >= minutes:
        return [minutes]
    cuts = [every] * int(minutes // every)
    rest = minutes - sum(cuts)
    return cuts + [rest] if rest > 1e-9 else cuts


def main(argv: list[str] | None = None) -> int:
    args, serve_flags = parse(sys.argv[1:] if argv is None else argv)
    from lmengine.engine.loader import resolve_model_path

    model = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="lmengine-soak-"))
    (work / "qos.json").write_text(json.dumps(QOS_CONFIG))
    adapter = make_adapter(model, work / "adapters" / "soak")
    busy = check_idle(args.force, wait_s=0 if args.force else 120)
    flags = [
        "--max-queued-requests", str(args.queue_limit),
        "--qos-config-path", str(work / "qos.json"),
        "--served-model-name", "soak",
    ]  # fmt: skip
    if adapter is not None:
        flags += ["--enable-lora-updates", "--lora-root", str(work / "adapters")]
    log(f"lmengine serve {model} {' '.join(flags + serve_flags)}")
    proc, url = start_server(model, flags + serve_flags, work / "server.log", args.port, 900)
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        load = Load(url, "soak", adapter_path=adapter, queue_limit=args.queue_limit,
                    max_tokens=args.max_tokens)  # fmt: skip
        log(f"warm-up: {args.warmup_minutes:g} min")
        load.run(args.warmup_minutes * 60, args.workers)
        wait_idle(url)
        baseline = snapshot(proc.pid, url)
        log(f"after the warm-up: {baseline}")
        load.tally = type(load.tally)()  # the soak's own counts
        watcher = Watcher(proc.pid, url, load.tally, every_s=args.every)
        watcher.start()
        log(f"soak: {args.minutes:g} min, {args.workers} clients")
        checkpoints = []
        pieces = segments(args.minutes, args.idle_every)
        for i, minutes in enumerate(pieces):
            tally = load.run(minutes * 60, args.workers)
            if i + 1 < len(pieces):
                wait_idle(url)  # the load pauses: idle RSS, the allocator's memory handed back
                checkpoints.append({"t": watcher.elapsed(), **snapshot(proc.pid, url)})
                log(f"idle checkpoint: {checkpoints[-1]}")
        series = watcher.stop()
        final = idle_check(proc.pid, url, baseline, rss_tolerance=args.rss_tolerance)
    finally:
        proc.terminate()
        exit_code = proc.wait(timeout=120)
    num_5xx = tally.num_unexpected_5xx
    report = {
        "cpu": cpu_model(),
        "date": started.isoformat(timespec="seconds"),
        "command": command_line(),
        "model": model,
        "serve_flags": flags + serve_flags,
        "minutes": args.minutes,
        "workers": args.workers,
        "busy_before": round(busy, 3),
        "series": series,
        "drift_window_s": drift_window(args.minutes * 60),
        "drift": drift(series, drift_window(args.minutes * 60)),
        "latency_by_minute": tally.latency_by_minute(),
        "answers": tally.counts,
        "unexpected": tally.unexpected,
        "num_unexpected": tally.num_unexpected,
        "num_unexpected_5xx": num_5xx,
        "num_lost_connections": tally.num_lost,
        "idle_checkpoints": checkpoints,
        "final": final,
        "server_exit_code": exit_code,
    }
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    log(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
    for name, d in report["drift"].items():
        print(f"{name:>15}: {d['first']:>10} -> {d['last']:>10} ({d['change']:+})")
    print(f"answers: {tally.statuses()}; unexpected: {tally.num_unexpected} ({num_5xx} 5xx)")
    idle_rss = [round(c["rss_mb"]) for c in checkpoints] + [round(final["idle"]["rss_mb"])]
    print(f"idle RSS (MB): after the warm-up {round(baseline['rss_mb'])}, then {idle_rss}")
    print(f"idle again: {final['checks']}, RSS {final['rss_change']:+.1%}")
    failed = num_5xx > 0 or tally.num_lost > 0 or not final["passed"] or exit_code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
