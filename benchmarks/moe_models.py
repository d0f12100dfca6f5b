"""lmengine, transformers and vLLM on Qwen3-MoE and gpt-oss shapes (random weights), W1.

    python benchmarks/moe_models.py --vllm-python VENV/bin/python [--shape qwen3-moe,gpt-oss]
        [--rounds 3] [--w1-prompts 16] [--w1-new-tokens 32] [--layers 4] [--json moe.json]
    python benchmarks/moe_models.py --shape tiny --force --rounds 1 ...   # the pipeline, fast

Two mixtures of experts at their real width, a few layers deep: Qwen3-30B-A3B's (hidden 2048,
128 experts, top-8, expert width 768, 32 query / 4 KV heads of 128) and gpt-oss-20b's (hidden
2880, 32 experts, top-4, expert width 2880, 64 query / 8 KV heads of 64, attention sinks,
sliding window 128 on every other layer, YaRN rotary), their weights random from a fixed seed
and in bfloat16 (gpt-oss's experts unquantized, as in its BF16 releases), SmolLM2's tokenizer
and vocabulary (a smaller LM head than theirs), untied. The outputs are meaningless; the
router spreads tokens over the experts as a trained one roughly does. `tiny` (a Qwen3-MoE)
and `tiny-gpt-oss` check the pipeline in a few minutes. The first run writes each shape into
--keep-dir (default: lmengine's cache, moe_models/; later runs reuse it, --layers makes
another): at 4 layers Qwen3-MoE has 2.7 B parameters (5.4 GB on disk), gpt-oss 3.6 B (7.1 GB).

Engines, each in a process of its own (benchmarks/peer_engines.py says how each is timed), all
in bfloat16 (lmengine's default on a CPU with bf16 matrix units, vLLM's default dtype) on the
same folder: lmengine with EngineConfig's defaults; transformers' own `generate`, eager
attention, its default experts implementation, the prompts left-padded into one batch
(--hf-batch for smaller ones); vLLM's CPU build (VENV as for benchmarks/peers.py) with a
3 GiB KV cache. An engine that fails (vLLM without a CPU path for an architecture, lmengine
before its patch lands) is recorded with its error and the others go on.

The workload is peers.py's W1 on the same token ids: its first --w1-prompts chat prompts,
--w1-new-tokens new tokens each, all handed over in one call, greedy, EOS ignored; output
tokens / wall time. The default (16 x 32) is sized for two cores. Engines run one at a time,
the order reversed every other round; before each the machine must be idle (--force goes on
anyway), and a run during which other processes took more than 10 % of the CPUs is marked.
Reported per engine: median and spread (lowest-highest) over every timed run, lmengine's ratio
to each peer (medians), and how many of the first 16 greedy outputs equal lmengine's and
transformers' (random weights leave near ties: rounding alone flips some).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import peers  # noqa: E402  (benchmarks/peers.py: the workloads, CPU accounting, agreement)
import scale  # noqa: E402  (benchmarks/scale.py: its seed, vLLM's KV size, versions)

QWEN3_MOE_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
GPT_OSS_ROPE = {  # gpt-oss's rope_scaling
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


@dataclass(frozen=True)
class Shape:
    """A model's transformers config (all but the layer count, the vocabulary and the special
    tokens), its default depth and the W1 size it runs by default."""

    name: str
    config_class: str  # a transformers config class
    config: dict
    num_layers: int
    w1_prompts: int
    w1_new_tokens: int


def _qwen3_moe(**dims) -> dict:
    defaults = dict(
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters=dict(QWEN3_MOE_ROPE),
        tie_word_embeddings=False,
    )
    return defaults | dims


def _gpt_oss(**dims) -> dict:
    defaults = dict(
        attention_bias=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters=dict(GPT_OSS_ROPE),
        swiglu_limit=7.0,
        tie_word_embeddings=False,
    )
    return defaults | dims


SHAPES = {
    "qwen3-moe": Shape(
        "Qwen3-30B-A3B",
        "Qwen3MoeConfig",
        _qwen3_moe(
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,  # the dense MLP's, unused: every layer is sparse
        ),
        4,
        16,
        32,
    ),
    "gpt-oss": Shape(
        "gpt-oss-20b",
        "GptOssConfig",
        _gpt_oss(
            hidden_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            intermediate_size=2880,
            sliding_window=128,
        ),
        4,
        16,
        32,
    ),
    "tiny": Shape(
        "tiny Qwen3-MoE",
        "Qwen3MoeConfig",
        _qwen3_moe(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            intermediate_size=256,
        ),
        2,
        4,
        8,
    ),
    "tiny-gpt-oss": Shape(
        "tiny gpt-oss",
        "GptOssConfig",
        _gpt_oss(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=128,
            sliding_window=16,
        ),
        2,
        4,
        8,
    ),
}
ENGINES = ("lmengine", "transformers", "vllm")
# a traceback's last line, vLLM's engine core's behind "(EngineCore_DP0 pid=1) "
EXCEPTION = re.compile(r"^(\([^)]*\) )?[\w.]*(Error|Exception|Interrupt): ")


def write_folder(shape: Shape, num_layers: int, folder: Path, tokenizer_path: str) -> None:
    """The shape as a transformers folder in bfloat16, random weights from scale.SEED; gpt-oss's
    layers alternate sliding and full attention, the first sliding."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    extra = {}
    if shape.config_class == "GptOssConfig":
        extra["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
    config = getattr(transformers, shape.config_class)(
        **shape.config,
        **extra,
        num_hidden_layers=num_layers,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(scale.SEED)
    # NOTE: made in bfloat16 directly: float32 would take twice the memory
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")  # a folder is complete or absent
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)


def prepare(key: str, num_layers: int, keep_dir: Path, tokenizer_path: str) -> Path:
    """The shape's folder in keep_dir, written if missing."""
    folder = keep_dir / f"{key}-{num_layers}l"
    if not folder.exists():
        start = time.monotonic()
        write_folder(SHAPES[key], num_layers, folder, tokenizer_path)
        print(f"wrote {folder} in {time.monotonic() - start:.0f} s", flush=True)
    return folder


def parameter_counts(folder: Path, config: dict) -> tuple[int, int]:
    """(all parameters, those one token uses: the experts' times top-k / number of experts)."""
    from safetensors import safe_open

    top_k = config["num_experts_per_tok"]
    num_experts = config.get("num_experts") or config["num_local_experts"]
    total = experts = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                count = 1
                for size in f.get_slice(name).get_shape():
                    count *= size
                total += count
                experts += count if ".experts." in name else 0
    return total, total - experts + experts * top_k // num_experts


def error_line(text: str) -> str:
    """What an engine's output says went wrong: its first exception (the root cause: vLLM's
    engine core raises one, its front end another that says "see above") and its last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = list(dict.fromkeys(line for line in lines if EXCEPTION.match(line)))
    if not named:
        return (lines or ["(no output)"])[-1][:300]
    return named[0][:300] + (f" (last: {named[-1][:200]})" if len(named) > 1 else "")


def run_engine(args, engine: str, folder: Path, workloads: Path, tmp: Path) -> dict:
    """One engine on one shape, in a process (group) of its own, as scale.run_engine runs it
    but for the transformers engine and a time limit; RuntimeError if it fails."""
    from lmengine.bench.report import check_idle

    busy = check_idle(args.force, wait_s=0 if args.force else 120)
    env, python = dict(os.environ), sys.executable
    if engine == "vllm":
        python = args.vllm_python
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(scale.VLLM_KV_GIB)
        iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    out = tmp / f"{engine}.json"
    cmd = [python, str(peers.RUNNER), engine, "--model", str(folder), "--dtype", "bfloat16"]
    cmd += ["--workloads", str(workloads), "--out", str(out), "--reps", str(args.reps)]
    if engine == "transformers":
        cmd += ["--batch", str(args.hf_batch)]
    print(f"{time.strftime('%H:%M:%S')} {engine}", flush=True)
    busy0, own0, start = peers.cpu_seconds(), peers.children_seconds(), time.monotonic()
    # NOTE: a group of its own: vLLM's engine core is a child process, killed with it
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\nTimeoutError: killed after {args.timeout} s"
    except BaseException:  # Ctrl-C reaches this process only: the group is not in the foreground
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.monotonic() - start
    others = (peers.cpu_seconds() - busy0) - (peers.children_seconds() - own0)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{stdout[-3000:]}\n{stderr[-12000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    share = max(0.0, others) / (wall * (os.cpu_count() or 1))
    result.update(engine=engine, wall_s=wall, busy_before=busy, others_share=share)
    result["disturbed"] = share > 0.10
    return result


def summarize(runs: list[dict]) -> dict:
    """Per engine: W1 tok/s median, lowest and highest over every timed run of every round;
    lmengine's ratio to each peer (medians; above 1: lmengine better); how many greedy
    outputs equal lmengine's and transformers' (the reference implementation)."""
    summary: dict = {}
    for engine in dict.fromkeys(r["engine"] for r in runs):
        mine = [r for r in runs if r["engine"] == engine]
        values = [rep["out_tok_s"] for r in mine for rep in r["W1"]["reps"]]
        summary[engine] = {
            "runs": len(values),
            "median": statistics.median(values),
            "low": min(values),
            "high": max(values),
            "others_share_max": max(r["others_share"] for r in mine),
            "disturbed_runs": sum(r["disturbed"] for r in mine),
            "how": mine[0].get("how", ""),
        }
    firsts = {r["engine"]: r for r in reversed(runs)}  # each engine's first run
    for engine, row in summary.items():
        if "lmengine" in firsts and engine != "lmengine":
            row["lmengine_ratio"] = summary["lmengine"]["median"] / row["median"]
        for other in ("lmengine", "transformers"):
            if other in firsts and engine != other:
                row[f"w1_greedy_equal_{other}"] = peers.agreement(firsts[other], firsts[engine])
    return summary


def billions(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count / 1e6:.1f} M"


def report(record: dict, machine: str) -> str:
    """One shape as markdown: the summary table, every run, the engines that failed."""
    c = record["config"]
    num_experts = c.get("num_experts") or c["num_local_experts"]
    expert_size = c.get("moe_intermediate_size") or c["intermediate_size"]
    lines = [
        f"\n### {record['name']} shape, {c['num_hidden_layers']} layers, random weights",
        "",
        f"{machine}. hidden {c['hidden_size']}, {num_experts} experts of {expert_size}, "
        f"top-{c['num_experts_per_tok']}, {c['num_attention_heads']} / "
        f"{c['num_key_value_heads']} heads of {c['head_dim']}; {billions(record['params'])} "
        f"parameters, {billions(record['active_params'])} active; bfloat16. W1: "
        f"{record['w1_prompts']} prompts x {record['w1_new_tokens']} new tokens, one call, "
        "greedy, EOS ignored.",
        "",
        "| engine | W1 out tok/s median | lowest-highest | runs | lmengine / engine "
        "| W1 greedy = lmengine | = transformers | others' CPU (max) |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for engine, row in record["summary"].items():
        ratio = f"{row['lmengine_ratio']:.2f}" if "lmengine_ratio" in row else "-"
        idle = f"{row['others_share_max']:.0%}"
        if row["disturbed_runs"]:
            idle += f" ({row['disturbed_runs']} run(s) disturbed)"
        lines.append(
            f"| {engine} | {row['median']:.1f} | {row['low']:.1f}-{row['high']:.1f} | "
            f"{row['runs']} | {ratio} | {row.get('w1_greedy_equal_lmengine', '-')} | "
            f"{row.get('w1_greedy_equal_transformers', '-')} | {idle} |"
        )
    for engine, error in record["failed"].items():
        lines.append(f"| {engine} | failed | | | | | | {error_line(error).replace('|', '/')} |")
    if record["runs"]:
        lines += ["", "| round | engine | W1 out tok/s | busy before | others' CPU |"]
        lines.append("| ---: | --- | ---: | ---: | --- |")
    for r in record["runs"]:
        mark = " (disturbed)" if r["disturbed"] else ""
        lines.append(
            f"| {r['round']} | {r['engine']} | {r['W1']['out_tok_s']:.1f} | "
            f"{r['busy_before']:.0%} | {r['others_share']:.0%}{mark} |"
        )
    how = [f"{e}: {row['how']}" for e, row in record["summary"].items() if row["how"]]
    if how:
        lines.append("\n" + "; ".join(how))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--shape",
        action="append",
        help=f"one of {sorted(SHAPES)}, repeatable or a comma list (default: qwen3-moe,gpt-oss)",
    )
    p.add_argument(
        "--engines",
        help=f"comma list of {', '.join(ENGINES)} (default: all, vllm if --vllm-python is given)",
    )
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu")
    p.add_argument("--rounds", type=int, default=3, help="every engine once per round")
    p.add_argument("--reps", type=int, default=1, help="timed W1 runs per engine and round")
    defaults = ", ".join(f"{k} {v.num_layers}" for k, v in SHAPES.items())
    p.add_argument("--layers", type=int, help=f"decoder layers ({defaults})")
    defaults = ", ".join(f"{k} {v.w1_prompts}" for k, v in SHAPES.items())
    p.add_argument("--w1-prompts", type=int, help=f"W1 prompts ({defaults})")
    defaults = ", ".join(f"{k} {v.w1_new_tokens}" for k, v in SHAPES.items())
    p.add_argument("--w1-new-tokens", type=int, help=f"W1 new tokens per prompt ({defaults})")
    p.add_argument(
        "--hf-batch", type=int, default=0, help="transformers: prompts per generate call (0: all)"
    )
    p.add_argument(
        "--timeout", type=float, default=3600, help="seconds before an engine's run is killed"
    )
    p.add_argument(
        "--keep-dir",
        type=Path,
        help="where the generated folders stay (default: lmengine's cache, moe_models/)",
    )
    p.add_argument(
        "--tokenizer",
        help="folder whose tokenizer the models get (default: lmengine's default model)",
    )
    p.add_argument(
        "--workloads",
        type=Path,
        help="peers.py's workloads as JSON (default: built with the default model's tokenizer)",
    )
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    args = p.parse_args(argv)
    args.shape = [
        s.strip()
        for given in args.shape or ["qwen3-moe,gpt-oss"]
        for s in given.split(",")
        if s.strip()
    ]
    if bad := [s for s in args.shape if s not in SHAPES]:
        p.error(f"--shape {bad}: one of {sorted(SHAPES)}")
    if args.engines is None:
        args.engines = [e for e in ENGINES if e != "vllm" or args.vllm_python]
    else:
        args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        if bad := [e for e in args.engines if e not in ENGINES]:
            p.error(f"--engines {bad}: a comma list of {', '.join(ENGINES)}")
        if "vllm" in args.engines and not args.vllm_python:
            p.error("--engines vllm needs --vllm-python")
    for name in ("rounds", "reps", "layers", "w1_prompts", "w1_new_tokens", "timeout"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.hf_batch < 0:
        p.error("--hf-batch must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    from lmengine.bench.report import cpu_model
    from lmengine.engine.loader import cache_dir, resolve_model_path

    args = parse_args(argv)
    keep_dir = args.keep_dir or cache_dir() / "moe_models"
    keep_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or resolve_model_path(None)
    found = scale.versions(argparse.Namespace(vllm_python=args.vllm_python, llamacpp_python=None))
    found |= {"transformers": transformers.__version__, "torch": torch.__version__}
    out = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "versions": found,
        "engines": args.engines,
        "how": {
            "lmengine": "bfloat16, EngineConfig defaults",
            "transformers": f"bfloat16, generate, eager attention, batch {args.hf_batch or 'all'}",
            "vllm": f"bfloat16, KV cache {scale.VLLM_KV_GIB} GiB, OpenMP on every core",
        },
        "rounds": args.rounds,
        "reps": args.reps,
        "shapes": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        full = args.workloads or Path(tmp) / "workloads.json"
        if args.workloads is None:
            peers.build_workloads(full)
        w1 = json.loads(full.read_text())["W1"]
        for key in args.shape:
            shape = SHAPES[key]
            folder = prepare(key, args.layers or shape.num_layers, keep_dir, tokenizer)
            num_prompts = args.w1_prompts or shape.w1_prompts
            new_tokens = args.w1_new_tokens or shape.w1_new_tokens
            if num_prompts > len(w1["prompts"]):
                sys.exit(f"--w1-prompts {num_prompts}: W1 has {len(w1['prompts'])} prompts")
            wl_path = Path(tmp) / f"workloads-{key}.json"
            workload = {"prompts": w1["prompts"][:num_prompts], "max_new_tokens": new_tokens}
            wl_path.write_text(json.dumps({"W1": workload}))
            runs: list[dict] = []
            failed: dict[str, str] = {}
            for round_ in range(1, args.rounds + 1):
                order = args.engines if round_ % 2 else args.engines[::-1]
                for engine in [e for e in order if e not in failed]:
                    try:
                        result = run_engine(args, engine, folder, wl_path, Path(tmp))
                    except RuntimeError as error:  # the other engines still run
                        print(error, file=sys.stderr, flush=True)
                        failed[engine] = str(error)
                        continue
                    print(f"  {result['W1']['out_tok_s']:.1f} tok/s", flush=True)
                    runs.append({**result, "round": round_})
            config = json.loads((folder / "config.json").read_text())
            total, active = parameter_counts(folder, config)
            record = {
                "shape": key,
                "name": shape.name,
                "folder": str(folder),
                "config": config,
                "params": total,
                "active_params": active,
                "w1_prompts": num_prompts,
                "w1_new_tokens": new_tokens,
                "summary": summarize(runs) if runs else {},
                "failed": failed,
                "runs": runs,
            }
            out["shapes"].append(record)
            machine = f"{out['cpu']}, {out['cpu_count']} cores, {out['date']}"
            print(report(record, machine), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\n{out['versions']}")
    return 0 if all(not s["failed"] for s in out["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
