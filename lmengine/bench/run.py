"""One run of `lmengine bench`: load both systems, run the selected workloads, print the
report, and write every result as JSON when asked."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from lmengine.bench.measure import log
from lmengine.bench.report import command_line, machine_info, report
from lmengine.bench.results import LM, ratios
from lmengine.bench.workloads import Bench


def run_benchmarks(args: argparse.Namespace) -> int:
    """Run the selected workloads, print the report, maybe write JSON; 1 if lmengine failed."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    command = command_line()
    info = machine_info()
    bench = Bench(args)
    try:
        bench.load()
        for name in args.workloads:
            getattr(bench, name)()
        bench.transformers_cb()
    finally:
        bench.close()
    result_ratios = ratios(bench.rows)
    print(report(bench, info, command, result_ratios), flush=True)
    if args.json:
        result = {
            "command": command,
            "machine": info,
            "model": bench.path,
            "engine_config": asdict(bench.engine_config),
            "sizes": asdict(bench.sizes),
            "repeat": bench.repeat,
            "workloads": args.workloads,
            "workload_desc": bench.workload_desc,
            "setup": bench.setup,
            "rows": [r.to_dict() for r in bench.rows],
            "ratios": result_ratios,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        log(f"wrote {args.json}")
    failed = any(r.system == LM and r.error for r in bench.rows)
    return 1 if failed else 0
