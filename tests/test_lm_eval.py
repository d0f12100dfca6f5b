"""lm-evaluation-harness end to end, as users run it: `lm_eval --model local-completions`
against a real `lmengine serve` of the tiny model, and `lm_eval --model hf` on the same
folder, over the local tasks of tests/lm_eval_tasks (a multiple-choice task scored by
log-likelihood and a generate-until task). Per request, the log-likelihoods agree within
1e-4 and the greedy flags, generations and accuracies are identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_server import tiny_server

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
TOL = 1e-4


def run_lm_eval(out: Path, model: str, model_args: str) -> dict:
    """`lm_eval` in a subprocess, offline; returns {task: {doc_id: sample}} and the metrics."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    lm_eval = Path(sys.executable).parent / "lm_eval"
    cmd = [
        str(lm_eval), "--model", model, "--model_args", model_args,
        "--tasks", "lmengine_mc,lmengine_gen", "--include_path", str(TASKS),
        "--batch_size", "1", "--log_samples", "--output_path", str(out),
    ]  # fmt: skip
    if model == "hf":
        cmd += ["--device", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    samples: dict[str, dict[int, dict]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.split("_20")[0].removeprefix("samples_")
        with path.open() as f:
            samples[task] = {s["doc_id"]: s for s in map(json.loads, f)}
    (results_path,) = list(out.rglob("results_*.json"))
    return {"samples": samples, "results": json.loads(results_path.read_text())["results"]}


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    with tiny_server(
        tiny_llama_path, "--served-model-name", "tiny", "--num-gpu-blocks", "256"
    ) as url:
        yield url


def test_lm_eval_local_completions_equals_the_hf_backend(served, tiny_llama_path, tmp_path):
    # NOTE: no tokenizer given: lm-eval finds /tokenizer_info and tokenizes through /tokenize
    api = run_lm_eval(
        tmp_path / "api",
        "local-completions",
        f"model=tiny,base_url={served}/v1/completions,max_retries=1",
    )
    hf = run_lm_eval(tmp_path / "hf", "hf", f"pretrained={tiny_llama_path},dtype=float32")
    mc_api, mc_hf = api["samples"]["lmengine_mc"], hf["samples"]["lmengine_mc"]
    assert sorted(mc_api) == sorted(mc_hf) and len(mc_api) == 10
    num_requests = 0
    for doc_id, sample in mc_hf.items():
        for (want_lp, want_greedy), (got_lp, got_greedy) in zip(
            sample["filtered_resps"], mc_api[doc_id]["filtered_resps"], strict=True
        ):
            assert abs(float(got_lp) - float(want_lp)) < TOL, (doc_id, got_lp, want_lp)
            assert got_greedy == want_greedy
            num_requests += 1
        assert mc_api[doc_id]["acc"] == sample["acc"]
        assert mc_api[doc_id]["acc_norm"] == sample["acc_norm"]
    assert num_requests >= 30
    gen_api, gen_hf = api["samples"]["lmengine_gen"], hf["samples"]["lmengine_gen"]
    assert sorted(gen_api) == sorted(gen_hf)
    for doc_id, sample in gen_hf.items():
        assert gen_api[doc_id]["resps"] == sample["resps"], doc_id  # stop strings cut alike
    for task in ("lmengine_mc", "lmengine_gen"):
        want = {k: v for k, v in hf["results"][task].items() if k != "alias"}
        got = {k: v for k, v in api["results"][task].items() if k != "alias"}
        assert got == want, task
