"""The benchmark harness (`lmengine bench`) without a model: flags and sizes, prompt building,
alternating timed runs, rows and ratios, and the report's tables."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmengine.bench import DEFAULT_PROMPT_FILE, HF_CB, HF_STATIC, LM, Row, add_bench_flags
from lmengine.bench.flags import Sizes
from lmengine.bench.measure import measure_interleaved
from lmengine.bench.prompts import Prompts, long_prompt, read_lines
from lmengine.bench.report import markdown, plain, report, table
from lmengine.bench.results import find_row, ratios

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_bench_flags(parser)
    return parser.parse_args(list(argv))


def test_flags_resolve_to_sizes():
    args = parse()
    assert args.workloads == ["w1", "w2", "w3"] and args.repeat == 1
    assert Path(args.prompt_file) == DEFAULT_PROMPT_FILE and DEFAULT_PROMPT_FILE.is_file()
    full = Sizes.from_args(args)
    assert (full.num_prompts, full.max_new_tokens, full.w3_prompt_tokens) == (64, 128, 1000)
    quick = Sizes.from_args(parse("--quick", "--max-new-tokens", "5"))
    assert (quick.num_prompts, quick.max_new_tokens, quick.w3_prompt_tokens) == (8, 5, 256)
    assert parse("--workloads", "W3, w1").workloads == ["w1", "w3"]  # always in W1..W3 order
    with pytest.raises(ValueError, match="w2-new-tokens"):
        Sizes.from_args(parse("--w2-new-tokens", "1"))


@pytest.mark.parametrize(
    "argv", [["--workloads", "w4"], ["--repeat", "0"], ["--block-size", "-1"], ["--json"]]
)
def test_bad_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_throughput_script_refuses_an_abbreviated_flag(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("throughput", ROOT / "benchmarks/throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ran = []
    monkeypatch.setattr(module, "run_benchmarks", lambda args: ran.append(args) or 0)
    assert module.main(["--skip-hf-batch", "--quick"]) == 0 and ran[0].skip_hf_batch
    with pytest.raises(SystemExit) as exc:
        module.main(["--skip-hf", "--quick"])  # --skip-hf-batch, abbreviated
    assert exc.value.code == 2 and len(ran) == 1
    assert "unrecognized arguments: --skip-hf" in capsys.readouterr().err


class WordTokenizer:
    """One id per word; no chat template, so prompts are the raw text."""

    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [len(w) for w in text.split()]}


def test_prompts_reach_their_sizes_and_no_more(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("one two three\n\n  four five  \nsix\nseven eight nine ten\n")
    lines = read_lines(str(path))
    assert lines == ["one two three", "four five", "six", "seven eight nine ten"]
    tok = WordTokenizer()
    sizes = Sizes.from_args(parse("--num-prompts", "6", "--w2-prompt-tokens", "9"))
    sizes.w2_new_tokens, sizes.w3_num_prompts, sizes.w3_prompt_tokens = 2, 2, 20
    prompts = Prompts.build(tok, lines, sizes)
    assert [len(ids) for ids in prompts.w1] == [3, 2, 1, 4, 3, 2]  # cycling through the lines
    # whole lines, the fewest that reach the size: 3+2+1+4 words (3+2+1 = 6 falls short of 9)
    assert prompts.w2 == [3, 3, 5, 4, 4, 3, 5, 5, 4, 3]
    assert len(long_prompt(tok, lines, 0, 11)) == 13  # 3+2+1+4+3: 3+2+1+4 = 10 < 11
    # W3: prompts starting at lines spread over the file (lines 0 and 2), 20 words each
    assert prompts.w3[0][:3] == [3, 3, 5] and prompts.w3[1][:3] == [3, 5, 5]
    assert [len(ids) for ids in prompts.w3] == [20, 20]
    # KV blocks of the largest selected workload, one spare block per sequence, 8 spare in all
    assert prompts.needed_blocks(sizes, ["w2"], block_size=4) == 16 + 8  # the floor of 16
    expected_w1 = sum(-(-(len(x) + sizes.max_new_tokens) // 4) + 1 for x in prompts.w1) + 8
    assert prompts.needed_blocks(sizes, ["w1", "w2"], block_size=4) == expected_w1
    with pytest.raises(ValueError, match="no prompts"):
        empty = tmp_path / "empty.txt"
        empty.write_text("\n  \n")
        read_lines(str(empty))


def test_timed_runs_alternate_and_a_failing_system_stops(capsys):
    calls = []

    def system(name: str, metrics: list[str], fail_on_run: int | None):
        rows = [Row("W9", name, m) for m in metrics]
        count = [0]

        def run():
            count[0] += 1
            calls.append((name, count[0]))
            if count[0] == fail_on_run:
                raise RuntimeError(f"{name} broke")
            return [10.0 * count[0] + i for i in range(len(metrics))]

        return rows, lambda: calls.append((name, "warm-up")), run

    systems = [system("a", ["x", "y"], None), system("b", ["x"], 2), system("c", ["x"], None)]
    rows = measure_interleaved(systems, repeat=3)
    assert calls == [
        ("a", "warm-up"), ("b", "warm-up"), ("c", "warm-up"),
        ("a", 1), ("b", 1), ("c", 1),
        ("a", 2), ("b", 2), ("c", 2),
        ("a", 3), ("c", 3),
    ]  # fmt: skip
    assert [(r.system, r.metric, r.runs) for r in rows] == [
        ("a", "x", [10.0, 20.0, 30.0]),
        ("a", "y", [11.0, 21.0, 31.0]),
        ("b", "x", [10.0]),
        ("c", "x", [10.0, 20.0, 30.0]),
    ]
    assert rows[2].error == "RuntimeError: b broke" and rows[0].error is None
    err = capsys.readouterr().err
    assert "[bench] W9 b: FAILED: RuntimeError: b broke" in err
    assert "[bench] W9 a: run 3/3: x 30.00, y 31.00" in err
    assert capsys.readouterr().out == ""  # progress never reaches stdout


def test_rows_and_ratios():
    tps = Row("W2", LM, "decode tok/s", runs=[50.0, 40.0, 45.0])
    assert (tps.best, tps.median) == (50.0, 45.0)
    ttft = Row("W2", LM, "TTFT ms", runs=[30.0, 20.0], higher_is_better=False)
    hf_ttft = Row("W2", HF_STATIC, "TTFT ms", runs=[40.0], higher_is_better=False)
    assert ttft.best == 20.0 and ttft.speedup_over(hf_ttft) == 2.0
    assert Row("W1", LM, "m").speedup_over(tps) is None  # no runs: no ratio
    rows = [
        Row("W1", LM, "output tok/s", runs=[300.0]),
        Row("W1", HF_STATIC, "output tok/s", runs=[100.0]),
        Row("W1", HF_CB, "output tok/s", error="BenchError: boom"),
        ttft,
        hf_ttft,
    ]
    assert find_row(rows, "W1", HF_CB, "output tok/s") is None  # failed rows are not found
    assert ratios(rows) == {
        "w1 lmengine / transformers static": 3.0,
        "w1 lmengine / transformers generate_batch": None,  # ran, but failed
        "w2 TTFT: transformers / lmengine": 2.0,
        "w2 decode lmengine / transformers": None,  # no decode rows at all, yet W2 ran
    }  # W3 did not run: no key


def test_report_tables_plain_and_markdown():
    rows = [
        Row("W1", LM, "output tok/s", runs=[300.0, 200.0], note="preemptions=0"),
        Row("W1", HF_STATIC, "output tok/s", runs=[100.0]),
        Row("W1", HF_CB, "output tok/s", error="BenchError: a | b"),
    ]
    header, lines = table(rows)
    assert lines[0] == ["W1", LM, "output tok/s", "300.0", "250.0", "3.00", "preemptions=0"]
    assert lines[2][3:] == ["-", "-", "-", "ERROR: BenchError: a | b"]
    text = plain(header, lines).splitlines()
    assert text[0].split() == ["workload", "system", "metric", "best", "median", "vs"] + [
        "transformers",
        "static",
        "note",
    ]
    assert set(text[1]) == {"-", " "} and len(text) == 5
    assert text[2].index("300.0") == text[0].index("best")  # columns line up
    md = markdown(header, lines).splitlines()
    assert md[1] == "| --- | --- | --- | ---: | ---: | ---: | --- |"
    assert md[4].endswith("| ERROR: BenchError: a \\| b |")  # a pipe in a cell is escaped

    bench = SimpleNamespace(
        rows=rows,
        repeat=2,
        path="/models/tiny",
        workload_desc={"W1": "offline batch"},
        engine_config=SimpleNamespace(
            block_size=16, max_batch_size=8, max_prefill_token_num=512, num_gpu_blocks=40
        ),
    )
    info = dict(
        cpu="Some CPU",
        cpu_count=2,
        torch="2.x",
        torch_threads=2,
        transformers="5.x",
        lmengine="0.1.0",
        python="3.11",
        loadavg_at_start=[0.5, 0.5, 0.5],
    )
    out = report(bench, info, "lmengine bench --quick", ratios(rows))
    assert out.startswith("== lmengine vs transformers (float32, CPU, one process) ==\n")
    assert "command:  lmengine bench --quick\n" in out
    assert "engine:   block_size=16 max_batch_size=8 max_prefill_token_num=512 " in out
    assert "1 untimed warm-up + 2 timed run(s) per measurement" in out
    plain_part, md_part = out.split("---- markdown ----")
    assert "workload W1: offline batch" in plain_part and "- W1: offline batch" in md_part
    assert "  w1 lmengine / transformers static: 3.00" in plain_part
    assert "- w1 lmengine / transformers generate_batch: -" in md_part


def test_importing_the_harness_loads_neither_torch_nor_transformers():
    code = (
        "import sys, lmengine.bench\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _peer_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_peer_runner_times_lmengine_on_given_ids(tiny_llama_path, tmp_path):
    """benchmarks/peer_engines.py, as benchmarks/peers.py starts it for each engine."""
    workloads = {
        "W1": {"prompts": [[1, 2, 3], [4, 5, 6, 7], [8, 9]], "max_new_tokens": 5},
        "W2": {"prompts": [list(range(10, 40))], "max_new_tokens": 6},
        "W3": {"prompts": [list(range(50, 150)), list(range(200, 280))], "max_new_tokens": 1},
    }
    (tmp_path / "wl.json").write_text(json.dumps(workloads))
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/peer_engines.py"), "lmengine"]
    cmd += ["--model", tiny_llama_path, "--workloads", str(tmp_path / "wl.json")]
    cmd += ["--out", str(out), "--reps", "2", "--threads", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["engine"] == "lmengine"
    assert [len(o) for o in result["W1"]["outputs"]] == [5, 5, 5]
    assert [len(o) for o in result["W2"]["outputs"]] == [6]
    assert len(result["W1"]["reps"]) == 2 and result["W1"]["out_tok_s"] > 0
    assert result["W2"]["ttft_s"] > 0 and result["W2"]["decode_tok_s"] > 0
    for rep in result["W3"]["reps"]:  # 180 prompt tokens
        assert rep["prefill_tok_s"] == pytest.approx(180 / rep["ttft_s"])
    # the same ids give the same greedy tokens in-process
    from lmengine import GenerationConfig, pipeline

    with pipeline(tiny_llama_path) as pipe:
        cfg = GenerationConfig(max_new_tokens=5, ignore_eos=True)
        expected = [list(r.token_ids) for r in pipe(workloads["W1"]["prompts"], gen_config=cfg)]
    assert result["W1"]["outputs"] == expected


def test_the_peer_report_states_ratios_agreement_and_disturbance():
    peers = _peer_script("peers")

    def result(engine, round_, w1, ttft, decode, w3, outputs, share):
        return {
            "engine": engine,
            "round": round_,
            "W1": {"out_tok_s": w1, "outputs": outputs},
            "W2": {"ttft_s": ttft, "decode_tok_s": decode},
            "W3": {"prefill_tok_s": w3},
            "others_share": share,
            "disturbed": share > 0.10,
        }

    text = peers.report(
        [
            result("lmengine", 1, 500.0, 0.100, 40.0, 1100.0, [[1, 2], [3, 4]], 0.01),
            result("vllm", 1, 400.0, 0.125, 32.0, 1375.0, [[1, 2], [3, 5]], 0.25),
            result("llamacpp", 1, 250.0, 0.200, 80.0, 550.0, [[9, 9], [9, 9]], 0.0),
        ]
    )
    assert "| llamacpp | 1 | 250.0 | 200.0 | 80.0 | 550.0 | 0/2 | 0% |" in text
    assert (
        "lmengine / llamacpp (above 1: lmengine better): W1 out tok/s 2.00, W2 TTFT ms 2.00, "
        "W2 decode tok/s 0.50, W3 prefill tok/s 2.00" in text
    )
    assert "| vllm | 1 | 400.0 | 125.0 | 32.0 | 1375.0 | 1/2 | 25% (disturbed) |" in text
    assert "| lmengine | 1 | 500.0 | 100.0 | 40.0 | 1100.0 | - | 1% |" in text
    assert "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |" in text
    assert (
        "lmengine / vllm (above 1: lmengine better): W1 out tok/s 1.25, W2 TTFT ms 1.25, "
        "W2 decode tok/s 1.25, W3 prefill tok/s 0.80" in text
    )
