"""The `lmengine` command: generate (arguments, files, JSONL, every GenerationConfig flag) and
chat (multi-turn over stdin), run as real subprocesses."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from lmengine import EngineConfig, GenerationConfig
from lmengine.cli import build_dataclass, build_parser


def run_cli(*args, stdin: str | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "lmengine", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_of_every_command():
    for cmd in ("generate", "chat", "bench"):
        res = run_cli(cmd, "--help", timeout=60)
        assert res.returncode == 0 and "--" in res.stdout
    gen_help = run_cli("generate", "--help", timeout=60).stdout
    for f in dataclasses.fields(GenerationConfig):
        assert "--" + f.name.replace("_", "-") in gen_help
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in gen_help


def test_flags_build_the_configs():
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--max-new-tokens",
            "7",
            "--do-sample",
            "--top-p",
            "0.5",
            "--stop-words",
            "a",
            "b",
            "--stop-token-ids",
            "3",
            "4",
            "--block-size",
            "4",
            "--adapters",
            "x=/tmp/x",
            "--no-enable-prefix-caching",
        ]
    )
    gen = build_dataclass(GenerationConfig, args)
    eng = build_dataclass(EngineConfig, args)
    assert (gen.max_new_tokens, gen.do_sample, gen.top_p) == (7, True, 0.5)
    assert gen.stop_words == ["a", "b"] and gen.stop_token_ids == [3, 4]
    assert eng.block_size == 4 and eng.adapters == {"x": "/tmp/x"}
    assert eng.enable_prefix_caching is False


def test_generate_writes_jsonl(tiny_llama_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    out = tmp_path / "out.jsonl"
    res = run_cli(
        "generate",
        "an argument prompt",
        "--prompt-file",
        str(prompts),
        "--model",
        tiny_llama_path,
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--logprobs",
        "2",
        "--num-gpu-blocks",
        "64",
        "--jsonl",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["an argument prompt", "first prompt", "second prompt"]
    assert all(r["generate_token_len"] == 6 and r["finish_reason"] == "length" for r in records)
    assert all(len(r["logprobs"]) == 6 for r in records)
    assert "output tokens/s" in res.stderr


def test_generate_bad_flag_value_is_one_clear_line(tiny_llama_path):
    res = run_cli("generate", "x", "--model", tiny_llama_path, "--top-p", "7")
    assert res.returncode == 2 and "top_p must be <= 1" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_chat_is_multi_turn(smollm2_path):
    from lmengine import pipeline

    turns = ["My name is Ada.", "What is my name?"]
    res = run_cli(
        "chat",
        "--model",
        smollm2_path,
        "--max-new-tokens",
        "24",
        "--num-gpu-blocks",
        "128",
        stdin="\n".join(turns) + "\n/exit\n",
    )
    assert res.returncode == 0, res.stderr
    replies = [r.rstrip("\n") for r in res.stdout.split("assistant> ")[1:]]
    assert len(replies) == 2 and all(replies)
    # the second answer is the greedy answer to the whole conversation so far
    history = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": turns[1]},
    ]
    with pipeline(smollm2_path, EngineConfig(num_gpu_blocks=128)) as pipe:
        expected = pipe(history, gen_config=GenerationConfig(max_new_tokens=24)).text
        alone = pipe(turns[1], gen_config=GenerationConfig(max_new_tokens=24)).text
    assert replies[1] == expected
    assert expected != alone  # the history really changes the answer
