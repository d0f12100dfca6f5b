"""lm-evaluation-harness on a model two ways, as users run it, and the two compared request by
request: `lm_eval --model local-completions` against `lmengine serve`, and `lm_eval --model hf`
on the same checkpoint.

    python benchmarks/lm_eval_compare.py                       # SmolLM2, the local tasks
    python benchmarks/lm_eval_compare.py --model PATH --tasks lmengine_mc,lmengine_gen

Prints one markdown table: each task's metrics under both backends, the largest difference
between their per-request log-likelihoods, whether greedy flags and generations agree, and
the wall time of each lm_eval run (model loading included).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lmengine.engine.loader import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lm_eval(out: Path, model: str, model_args: str, tasks: str) -> tuple[dict, dict, float]:
    """One `lm_eval` run: (samples by task and doc id, results by task, wall seconds)."""
    cmd = [
        str(Path(sys.executable).parent / "lm_eval"), "--model", model,
        "--model_args", model_args, "--tasks", tasks, "--include_path", str(TASKS),
        "--batch_size", "1", "--log_samples", "--output_path", str(out),
    ]  # fmt: skip
    if model == "hf":
        cmd += ["--device", "cpu"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"lm_eval failed:\n{proc.stderr[-4000:]}")
    samples: dict[str, dict[int, dict]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.split("_20")[0].removeprefix("samples_")
        samples[task] = {s["doc_id"]: s for s in map(json.loads, path.open())}
    (results,) = list(out.rglob("results_*.json"))
    return samples, json.loads(results.read_text())["results"], seconds


def compare(api: dict, hf: dict) -> tuple[float, bool, bool]:
    """(largest |log-likelihood difference|, greedy flags equal, generations equal)."""
    diff, greedy_equal, gen_equal = 0.0, True, True
    for task, docs in hf.items():
        for doc_id, sample in docs.items():
            other = api[task][doc_id]
            if sample["filtered_resps"] and isinstance(sample["filtered_resps"][0], list):
                for (a, ga), (b, gb) in zip(sample["filtered_resps"], other["filtered_resps"]):
                    diff = max(diff, abs(float(a) - float(b)))
                    greedy_equal &= ga == gb
            else:
                gen_equal &= sample["resps"] == other["resps"]
    return diff, greedy_equal, gen_equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2)")
    parser.add_argument("--tasks", default="lmengine_mc,lmengine_gen")
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "lmengine", "serve", path, "--port", str(port),
         "--served-model-name", "model", "--enable-prefix-caching"],
        env={**ENV, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        with tempfile.TemporaryDirectory() as tmp:
            api = lm_eval(
                Path(tmp) / "api",
                "local-completions",
                f"model=model,base_url={url}/v1/completions",
                args.tasks,
            )
            hf = lm_eval(Path(tmp) / "hf", "hf", f"pretrained={path},dtype=float32", args.tasks)
    finally:
        server.terminate()
        server.wait()
    diff, greedy_equal, gen_equal = compare(api[0], hf[0])
    print("| task | metric | local-completions (lmengine serve) | hf |")
    print("| --- | --- | ---: | ---: |")
    for task, metrics in hf[1].items():
        for name, value in metrics.items():
            if name == "alias" or "stderr" in name or not isinstance(value, (int, float)):
                continue
            print(f"| {task} | {name} | {api[1][task][name]:.4f} | {value:.4f} |")
    print(f"\nlargest per-request log-likelihood difference: {diff:.2e}; greedy flags equal: "
          f"{greedy_equal}; generations equal: {gen_equal}; wall time: local-completions "
          f"{api[2]:.1f} s, hf {hf[2]:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
