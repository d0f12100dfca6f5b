"""Tensor parallelism launched as the README tells users to: `torchrun --nproc-per-node 2 -m
lmengine serve MODEL --tp 2`. Rank 0 serves, rank 1 is its worker; greedy answers equal tp=1
token for token; a world size other than --tp is a one-line error and nothing hangs; SIGTERM
stops every rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.api import Pipeline
from tests.test_server import ROOT, free_port, openai_client

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

PROMPTS = [[17, 410, 93, 1200, 7], [5, 6, 7, 8, 9, 10, 11], [300, 301, 302]]
FLAGS = ["--block-size", "4", "--num-gpu-blocks", "128"]


def torchrun(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", *args]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def test_torchrun_tp2_serves_what_tp1_computes(tiny_llama_path, tmp_path):
    port = free_port()
    log = (tmp_path / "torchrun.log").open("w")
    cmd = torchrun("-m", "lmengine", "serve", tiny_llama_path, "--tp", "2", "--port", str(port))
    proc = subprocess.Popen(cmd + FLAGS, env=env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "tp=2 under torchrun did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        create = openai_client(url).completions.create
        model = openai_client(url).models.list().data[0].id
        got = [
            create(model=model, prompt=p, max_tokens=8, temperature=0, logprobs=0) for p in PROMPTS
        ]
    finally:
        proc.terminate()
        proc.wait(60)
    for _ in range(100):  # every rank stopped with torchrun
        pattern = f"--port {port}"
        left = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
        assert left.returncode in (0, 1), left.stderr  # 1: no process matched
        if not left.stdout.strip():
            break
        time.sleep(0.1)
    assert not left.stdout.strip(), "a rank outlived torchrun"
    out = (tmp_path / "torchrun.log").read_text()
    assert out.count("lmengine serve: http://") == 1  # rank 0 serves, rank 1 does not
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(block_size=4, num_gpu_blocks=128))
    try:
        want = Pipeline(engine)(PROMPTS, gen_config=GenerationConfig(max_new_tokens=8))
        texts = [engine.tokenizer.decode(w.token_ids) for w in want]
    finally:
        engine.close()
    assert [g.choices[0].text for g in got] == texts
    assert all(g.usage.completion_tokens == 8 for g in got)


def test_torchrun_world_size_other_than_tp_is_one_clear_error(tiny_llama_path):
    cmd = torchrun("-m", "lmengine", "serve", tiny_llama_path, "--port", str(free_port()))
    run = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "torchrun started 2 processes: give --tp 2 (got --tp 1)" in run.stdout + run.stderr
