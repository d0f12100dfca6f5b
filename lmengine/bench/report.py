"""The report of a run: the command, the machine, the engine, how it ran, and one table of
every row, first as plain text, then the same as markdown."""

from __future__ import annotations

import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmengine.bench.results import HF_STATIC, Row, find_row

if TYPE_CHECKING:
    from lmengine.bench.workloads import Bench


def nearest_rank(values, q: float) -> float:
    """The q-th percentile (0-100) by nearest rank: the smallest value with at least q % of
    `values` at or below it (so always one of them)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def busy_fraction(seconds: float = 2.0) -> float:
    """Share of the CPUs' time spent outside idle over `seconds` (this process sleeps), from
    /proc/stat; the 1-minute load average would still count work that ended a minute ago."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def check_idle(force: bool, wait_s: float = 0.0, limit: float = 0.1) -> float:
    """The CPUs' busy fraction, waited on for up to `wait_s` seconds to fall to `limit`; past
    it the run stops (the figures would be wrong), or with `force` goes on with a warning."""
    deadline = time.monotonic() + wait_s
    busy = busy_fraction()
    while busy > limit and time.monotonic() < deadline:
        busy = busy_fraction()
    if busy > limit:
        message = f"the CPUs are {busy:.0%} busy: the figures would be wrong"
        if not force:
            sys.exit(f"{message} (--force to run anyway)")
        print(f"WARNING: {message}", file=sys.stderr, flush=True)
    return busy


def command_line() -> str:
    """The command that is running, as a user would type it again."""
    argv = list(sys.argv)
    prog = argv[0] if argv else "lmengine"
    if prog.endswith(".py"):
        head = ["python", os.path.relpath(prog) if os.path.isabs(prog) else prog]
    else:
        head = [Path(prog).name]
    return " ".join(shlex.quote(a) for a in head + argv[1:])


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    import lmengine

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lmengine": lmengine.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load] if load else None,
    }


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """(header, one line of cells per row); each row against transformers static's row."""
    header = ["workload", "system", "metric", "best", "median", "vs transformers static", "note"]
    lines = []
    for row in rows:
        base = find_row(rows, row.workload, HF_STATIC, row.metric)
        ratio = row.speedup_over(base) if row.error is None else None
        note = f"ERROR: {row.error}" if row.error else row.note
        lines.append(
            [
                row.workload,
                row.system,
                row.metric,
                fmt(row.best),
                fmt(row.median),
                fmt(ratio, 2),
                note,
            ]
        )
    return header, lines


def plain(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    widths[-1] = 0  # the note column is not padded
    row_fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [row_fmt.format(*header).rstrip(), "  ".join("-" * max(w, 4) for w in widths)]
    out += [row_fmt.format(*r).rstrip() for r in lines]
    return "\n".join(out)


def markdown(header: list[str], lines: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    align = ["---", "---", "---", "---:", "---:", "---:", "---"]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in lines]
    return "\n".join(out)


def report(bench: Bench, info: dict[str, Any], command: str, ratios: dict) -> str:
    """The whole text that `lmengine bench` prints on stdout."""
    header, lines = table(bench.rows)
    machine = (
        f"{info['cpu']}, {info['cpu_count']} cores; torch {info['torch']} "
        f"({info['torch_threads']} threads), transformers {info['transformers']}, "
        f"lmengine {info['lmengine']}, Python {info['python']}; "
        f"load average at start {info['loadavg_at_start']}"
    )
    cfg = bench.engine_config
    engine = (
        f"block_size={cfg.block_size} max_batch_size={cfg.max_batch_size} "
        f"max_prefill_token_num={cfg.max_prefill_token_num} num_gpu_blocks={cfg.num_gpu_blocks}"
    )
    how = (
        f"1 untimed warm-up + {bench.repeat} timed run(s) per measurement, lmengine and "
        "transformers static runs alternating; "
        "'vs transformers static' = best run / best transformers static run "
        "(TTFT inverted: > 1 means lmengine is faster)"
    )
    workloads = [f"{k}: {v}" for k, v in bench.workload_desc.items()]
    ratio_lines = [f"{k}: {fmt(v, 2)}" for k, v in ratios.items()]
    parts = [
        "== lmengine vs transformers (float32, CPU, one process) ==",
        f"command:  {command}",
        f"machine:  {machine}",
        f"model:    {bench.path}",
        f"engine:   {engine}",
        f"runs:     {how}",
        *[f"workload {w}" for w in workloads],
        "",
        plain(header, lines),
        "",
        "lmengine over transformers (best runs, > 1: lmengine better):",
        *[f"  {r}" for r in ratio_lines],
        "",
        "---- markdown ----",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Model: `{bench.path}`, float32; lmengine {engine}  ",
        f"{how}.",
        "",
        *[f"- {w}" for w in workloads],
        "",
        markdown(header, lines),
        "",
        "lmengine over transformers (best runs, > 1: lmengine better):",
        "",
        *[f"- {r}" for r in ratio_lines],
        "",
    ]
    return "\n".join(parts)
