"""The `lmengine` command: generate (arguments, files, JSONL, every GenerationConfig flag) and
chat (multi-turn over stdin), run as real subprocesses; no flag is abbreviated, and a missing
or unreadable path given to any flag is one line on stderr with exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from lmengine import EngineConfig, GenerationConfig
from lmengine.cli import build_dataclass, build_parser, main
from lmengine.config import PYTHON_ONLY_FIELDS
from lmengine.flags import check_model, looks_local


def run_cli(*args, stdin: str | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "lmengine", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_of_every_command():
    helps = {}
    for cmd in ("generate", "chat", "bench"):
        res = run_cli(cmd, "--help", timeout=60)
        assert res.returncode == 0 and "--" in res.stdout
        helps[cmd] = res.stdout
    gen_help = helps["generate"]
    for f in dataclasses.fields(GenerationConfig):
        flag = "--" + f.name.replace("_", "-")
        has_flag = re.search(re.escape(flag) + r"(?=[\s,])", gen_help) is not None
        # fields holding Python objects (tensors, callables) have no flag
        assert has_flag == (f.name not in PYTHON_ONLY_FIELDS), flag
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


# ---- flags are never abbreviated; bad paths are one line and exit status 2 ---------------------
def test_abbreviated_flag_is_an_argparse_error_not_a_traceback():
    # NOTE: --prompt used to be taken as --prompt-file, and the prompt as a file name
    res = run_cli("generate", "--prompt", "What is the capital of France?", timeout=60)
    assert res.returncode == 2, res.stderr
    assert "unrecognized arguments: --prompt" in res.stderr
    assert "Traceback" not in res.stderr and "FileNotFoundError" not in res.stderr


def test_no_parser_accepts_abbreviations(capsys):
    parsers = [build_parser()]
    for parser in list(parsers):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    assert len(parsers) == 6  # lmengine and its five commands
    assert all(p.allow_abbrev is False for p in parsers), [p.prog for p in parsers]
    for argv in (
        ["generate", "x", "--max-new", "3"],
        ["chat", "--sys", "be brief"],
        ["serve", "--api-key", "k"],
        ["quantize", "w8a8", "--out", "q", "--calib", "f.txt"],
        ["bench", "--rep", "2"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def one_error_line(capsys, command: str, path) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lmengine {command}: error: ") and str(path) in lines[0], err
    return lines[0]


def missing_path_cases(tmp_path):
    missing = tmp_path / "missing"
    draft = json.dumps({"method": "draft_model", "draft_model": str(missing)})
    return [
        (["generate", "x", "--prompt-file", str(missing)], "--prompt-file", missing),
        (["quantize", "w8a8", "--out", str(tmp_path / "q"), "--calib-file", str(missing)],
         "--calib-file", missing),
        (["serve", "--chat-template", str(missing)], "--chat-template", missing),
        (["serve", "--enable-lora-updates", "--lora-root", str(missing)], "--lora-root", missing),
        (["generate", "x", "--qos-config-path", str(missing)], "--qos-config-path", missing),
        (["chat", "--adapters", f"a={missing}"], "--adapters a", missing),
        (["generate", "x", "--speculative", draft], "--speculative draft_model", missing),
        (["generate", "x", "--model", str(missing)], "--model", missing),
        (["chat", "--model", "missing.gguf"], "--model", "missing.gguf"),
        (["generate", "x", "--model", "./missing"], "--model", "./missing"),
        (["generate", "x", "--model", "a/b/missing"], "--model", "a/b/missing"),
        (["serve", str(missing)], "MODEL", missing),
        (["quantize", "w8a8", str(missing), "--out", str(tmp_path / "q")], "MODEL", missing),
        (["generate", "x", "--jsonl", str(missing / "out.jsonl")], "--jsonl", missing),
    ]  # fmt: skip


@pytest.fixture()
def no_loading(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""
    import lmengine.quant.w8a8
    from lmengine import Engine

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(Engine, "from_pretrained", load)
    monkeypatch.setattr(lmengine.quant.w8a8, "quantize_checkpoint", load)


def test_every_missing_path_is_one_line_and_status_2(tmp_path, capsys, no_loading):
    for argv, flag, path in missing_path_cases(tmp_path):
        assert main(argv) == 2, argv
        line = one_error_line(capsys, argv[0], path)
        assert f"error: {flag}: no such" in line, line
    assert not (tmp_path / "q").exists()


def test_unreadable_paths_are_one_line_and_status_2(tmp_path, capsys, no_loading):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    text = tmp_path / "a_file.txt"
    text.write_text("not a model\n")
    cases = [
        (["generate", "x", "--prompt-file", str(folder)], "--prompt-file: not a file", folder),
        (["quantize", "w8a8", "--out", str(tmp_path / "q"), "--calib-file", str(folder)],
         "--calib-file: not a file", folder),
        (["serve", "--chat-template", str(folder)], "--chat-template: not a file", folder),
        (["serve", "--enable-lora-updates", "--lora-root", str(text)], "--lora-root: not a folder",
         text),
        (["generate", "x", "--qos-config-path", str(folder)], "--qos-config-path: not a file",
         folder),
        (["generate", "x", "--adapters", f"a={text}"], "--adapters a: not a folder", text),
        (["generate", "x", "--model", str(text)], "--model: not a checkpoint folder or .gguf",
         text),
        (["generate", "x", "--jsonl", str(folder)], "--jsonl: is a folder", folder),
    ]  # fmt: skip
    for argv, message, path in cases:
        assert main(argv) == 2, argv
        assert message in one_error_line(capsys, argv[0], path)
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert main(["generate", "--prompt-file", str(binary)]) == 2
    assert "not UTF-8 text" in one_error_line(capsys, "generate", binary)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_file_without_read_permission_is_one_line(tmp_path, capsys):
    secret = tmp_path / "prompts.txt"
    secret.write_text("hi\n")
    secret.chmod(0)
    assert main(["generate", "--prompt-file", str(secret)]) == 2
    assert "cannot read" in one_error_line(capsys, "generate", secret)


def test_hub_ids_go_to_the_loader_whose_error_is_one_line():
    assert not looks_local("org/name") and not looks_local("gpt2")
    assert all(looks_local(v) for v in ("/abs", "./x", "../x", "~/x", "x.gguf", "a/b/c"))
    check_model("--model", "org/name")  # hub-shaped: not checked here
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # NOTE: the hub is unreachable here anyway
    res = subprocess.run(
        [sys.executable, "-m", "lmengine", "generate", "x", "--model", "no-org/no-model"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("lmengine generate: error: cannot load the model 'no-org/no-model'")


def test_mapping_flag_without_equals_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "x", "--adapters", "just-a-name"])
    assert exc.value.code == 2
    assert "expected NAME=PATH, got 'just-a-name'" in capsys.readouterr().err
