"""lmengine, vLLM and llama.cpp on Llama-3.2-1B and -3B shapes (random weights), W1 / W2 / W3.

    python benchmarks/scale.py --shape 1b --vllm-python VENV/bin/python \
        --llamacpp-python LVENV/bin/python [--rounds 2] [--reps 1] [--json scale-1b.json]
    python benchmarks/scale.py --shape 3b ...             # smaller workloads, see SHAPES
    python benchmarks/scale.py --shape tiny --force ...   # the whole pipeline in minutes

SmolLM2-135M (benchmarks/peers.py) fits in a large CPU cache; these shapes are the sizes
people run, and their weights stream from memory. Each is a Llama with the real model's
dimensions, Llama 3's rope scaling (theta 500,000), tied embeddings and SmolLM2's tokenizer
and vocabulary, its weights random from a fixed seed: the outputs are meaningless, the timings
(EOS ignored) are the real model's but for a smaller LM head (49,152 rows, not 128,256). The
first run writes each shape into --keep-dir (default: lmengine's cache, scale/; later runs
reuse it, delete it to write it again): a transformers folder in bfloat16, and the same
weights as two GGUF files, Q8_0 and bf16, laid out as llama.cpp's converter lays them out
(same bytes; norms float32, Llama 3's rope as rope_freqs). 3B takes ~3 min and 7 GB of RAM.

Engines, each in a process of its own (benchmarks/peer_engines.py says how each is timed):
lmengine and vLLM's CPU build in bfloat16 (lmengine's default on a CPU with bf16 matrix units,
vLLM's default dtype) on the folder, vLLM with a 3 GiB KV cache; llama.cpp (llama-cpp-python,
batched, its AMX repacking off: with it Q8_0 crashes too) on each GGUF file. VENV and LVENV
are set up as for peers.py. The workloads are peers.py's, on the same token ids: W1 chat
prompts x new tokens, W2 one ~110-token prompt (TTFT, decode tok/s), W3 prompts of ~1,000
tokens (prefill). 3B runs fewer of them (SHAPES; --w1-prompts ... override), meant to take
under 25 minutes for two rounds on two cores; 1B runs peers.py's full sizes, 35-50 minutes.

Engines run one at a time, the order reversed every other round; before each the machine must
be idle (--force goes on anyway), and a run during which other processes took more than 10 %
of the CPUs is marked. Reported per engine: median and best over every timed run, lmengine's
ratio to each peer of the same run (medians), and how many of W1's first 16 greedy outputs
equal lmengine's (random weights leave near ties: rounding alone flips some).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import peers  # noqa: E402  (benchmarks/peers.py: the workloads, CPU accounting, agreement)


@dataclass(frozen=True)
class WorkloadSizes:
    """How much of peers.py's workloads a shape runs: W1's first `w1_prompts` prompts,
    `w1_new_tokens` new tokens each; W2's prompt, `w2_new_tokens` new tokens; W3's first
    `w3_prompts` prompts."""

    w1_prompts: int
    w1_new_tokens: int
    w2_new_tokens: int
    w3_prompts: int


@dataclass(frozen=True)
class Shape:
    """A Llama's dimensions, and the workload sizes it runs by default."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    sizes: WorkloadSizes


SHAPES = {
    "1b": Shape("Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, WorkloadSizes(64, 128, 256, 8)),
    "3b": Shape("Llama-3.2-3B", 3072, 28, 24, 8, 128, 8192, WorkloadSizes(8, 32, 64, 1)),
    "tiny": Shape("tiny", 256, 2, 4, 2, 64, 512, WorkloadSizes(4, 8, 8, 1)),
}
LLAMA3_ROPE = {  # Llama 3.2's rope_scaling
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GGUF_FILE_TYPES = {"q8_0": "MOSTLY_Q8_0", "bf16": "MOSTLY_BF16"}  # gguf.LlamaFileType names
ENGINES = ("lmengine", "vllm", "llamacpp-q8_0", "llamacpp-bf16")
SEED = 0
VLLM_KV_GIB = 3  # vLLM's KV cache; its default (a share of RAM) leaves none beside 3B weights


def write_folder(shape: Shape, folder: Path, tokenizer_path: str) -> None:
    """The shape as a transformers folder in bfloat16, random weights from SEED."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=len(tokenizer),
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(SEED)
    # NOTE: made in bfloat16 directly: the 3B shape in float32 would take 12 GB
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")  # a folder is complete or absent
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)


def write_gguf(folder: Path, path: Path, kind: str) -> None:
    """The folder's weights as a GGUF file of `kind` (q8_0 or bf16) as llama.cpp's converter
    writes a Llama: the 2-D weights in that type, the norms float32, query and key rows in its
    rotary order, Llama 3's rope scaling as the factors of a rope_freqs tensor; SmolLM2's
    tokenizer from lmengine's default GGUF file. One weight in memory at a time."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from lmengine.engine.gguf_blocks import LLAMA_LINEARS
    from tests.test_gguf_models import add_smollm2_tokenizer, converter_row_order

    qtype = gguf.GGMLQuantizationType[kind.upper()]
    config = AutoConfig.from_pretrained(folder)
    files = [safe_open(f, "pt") for f in sorted(folder.glob("*.safetensors"))]
    file_of = {name: f for f in files for name in f.keys()}

    def hf_weight(name: str, num_heads: int = 0):
        def load() -> np.ndarray:
            w = file_of[name].get_tensor(name).float().numpy()  # [out, in] or [hidden]
            if num_heads:
                w = converter_row_order(w, num_heads)
            return gguf.quants.quantize(w, qtype) if w.ndim == 2 else w

        shape = tuple(file_of[name].get_slice(name).get_shape())
        return shape, qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32, load

    # llama.cpp divides each rotary frequency by its factor: plain / Llama 3's
    dim, theta = config.head_dim, config.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    factors = (plain / LlamaRotaryEmbedding(config).inv_freq).numpy()  # [head_dim / 2]
    tensors = {
        "rope_freqs.weight": (factors.shape, gguf.GGMLQuantizationType.F32, lambda: factors),
        "token_embd.weight": hf_weight("model.embed_tokens.weight"),
        "output_norm.weight": hf_weight("model.norm.weight"),
    }
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        tensors[f"blk.{i}.attn_norm.weight"] = hf_weight(prefix + "input_layernorm.weight")
        tensors[f"blk.{i}.ffn_norm.weight"] = hf_weight(prefix + "post_attention_layernorm.weight")
        for part, hf_name in LLAMA_LINEARS.items():
            weight = hf_weight(f"{prefix}{hf_name}.weight", heads.get(part, 0))
            tensors[f"blk.{i}.{part}.weight"] = weight

    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    writer.add_name(f"{folder.name} (random)")
    writer.add_file_type(gguf.LlamaFileType[GGUF_FILE_TYPES[kind]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    add_smollm2_tokenizer(writer)
    for name, (shape, ggml_type, _) in tensors.items():
        nbytes = math.prod(gguf.quants.quant_shape_to_byte_shape(shape, ggml_type))
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, load in tensors.values():  # in the order of the infos
        writer.write_tensor_data(load())
    writer.close()
    partial.rename(path)


def prepare(shape_key: str, keep_dir: Path, tokenizer_path: str) -> dict[str, Path]:
    """The shape's folder and GGUF files in keep_dir, written where missing."""
    folder = keep_dir / f"llama-{shape_key}"
    files = {"folder": folder} | {
        k: keep_dir / f"llama-{shape_key}-{k}.gguf" for k in GGUF_FILE_TYPES
    }
    if not folder.exists():
        for kind in GGUF_FILE_TYPES:  # made from an older folder
            files[kind].unlink(missing_ok=True)
        start = time.monotonic()
        write_folder(SHAPES[shape_key], folder, tokenizer_path)
        print(f"wrote {folder} in {time.monotonic() - start:.0f} s", flush=True)
    for kind in GGUF_FILE_TYPES:
        if not files[kind].exists():
            start = time.monotonic()
            write_gguf(folder, files[kind], kind)
            print(f"wrote {files[kind]} in {time.monotonic() - start:.0f} s", flush=True)
    return files


def shape_workloads(full: dict, sizes: WorkloadSizes) -> dict:
    """peers.py's workloads cut to `sizes`: the first prompts, fewer new tokens."""
    return {
        "W1": {
            "prompts": full["W1"]["prompts"][: sizes.w1_prompts],
            "max_new_tokens": sizes.w1_new_tokens,
        },
        "W2": {"prompts": full["W2"]["prompts"], "max_new_tokens": sizes.w2_new_tokens},
        "W3": {"prompts": full["W3"]["prompts"][: sizes.w3_prompts], "max_new_tokens": 1},
    }


def run_engine(args, engine: str, files: dict[str, Path], workloads: Path, tmp: Path) -> dict:
    """One engine on one shape, in a process of its own, as peers.run_engine runs it."""
    from lmengine.bench.report import check_idle

    check_idle(args.force, wait_s=0 if args.force else 120)
    env = dict(os.environ)
    python, runner_engine, model = sys.executable, engine, files["folder"]
    if engine == "vllm":
        python = args.vllm_python
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(VLLM_KV_GIB)
        iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    elif engine.startswith("llamacpp-"):
        python, runner_engine = args.llamacpp_python, "llamacpp"
        model = files[engine.removeprefix("llamacpp-")]
    out = tmp / f"{engine}.json"
    cmd = [python, str(peers.RUNNER), runner_engine, "--model", str(model)]
    cmd += ["--workloads", str(workloads), "--out", str(out), "--reps", str(args.reps)]
    if engine in ("lmengine", "vllm"):
        cmd += ["--dtype", "bfloat16"]
    print(f"{time.strftime('%H:%M:%S')} {engine}", flush=True)
    busy0, own0, start = peers.cpu_seconds(), peers.children_seconds(), time.monotonic()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    others = (peers.cpu_seconds() - busy0) - (peers.children_seconds() - own0)
    if run.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    share = max(0.0, others) / (wall * (os.cpu_count() or 1))
    result.update(engine=engine, wall_s=wall, others_share=share, disturbed=share > 0.10)
    return result


def summarize(runs: list[dict]) -> dict:
    """Per engine and metric: median and best over every timed run of every round; lmengine's
    ratio to each peer (medians; above 1: lmengine better); W1 greedy agreement."""
    summary: dict = {}
    for engine in dict.fromkeys(r["engine"] for r in runs):
        mine = [r for r in runs if r["engine"] == engine]
        row: dict = {"runs": len(mine), "others_share_max": max(r["others_share"] for r in mine)}
        row["disturbed"] = any(r["disturbed"] for r in mine)
        for wl, key, _, _ in peers.METRICS:
            values = [rep[key] for r in mine for rep in r[wl]["reps"]]
            best = min(values) if key == "ttft_s" else max(values)
            row[f"{wl}_{key}"] = {"median": statistics.median(values), "best": best}
        summary[engine] = row
    base = next((r for r in runs if r["engine"] == "lmengine"), None)
    for engine, row in summary.items():
        if base is None or engine == "lmengine":
            continue
        first = next(r for r in runs if r["engine"] == engine)
        row["w1_greedy_equal_lmengine"] = peers.agreement(base, first)
        ratios = {}
        for wl, key, _, _ in peers.METRICS:
            ours, theirs = (s[f"{wl}_{key}"]["median"] for s in (summary["lmengine"], row))
            ratios[f"{wl}_{key}"] = theirs / ours if key == "ttft_s" else ours / theirs
        row["lmengine_ratio"] = ratios
    return summary


def report(shape: dict, machine: str) -> str:
    """One shape's summary as a markdown table and a line of ratios per peer."""
    s, summary = shape["sizes"], shape["summary"]
    lines = [
        f"\n{shape['name']} shape, random weights, {shape['params'] / 1e9:.2f} B parameters; "
        f"{machine}",
        f"W1 {s['w1_prompts']} prompts x {s['w1_new_tokens']} new tokens; W2 one "
        f"{shape['w2_prompt_tokens']}-token prompt x {s['w2_new_tokens']}; W3 {s['w3_prompts']} "
        f"prompt(s) of ~{shape['w3_prompt_tokens']} tokens; median (best) of every timed run",
        "",
    ]
    header = ["engine", "runs"] + [m[2] for m in peers.METRICS]
    header += ["W1 greedy = lmengine", "others' CPU (max)"]
    rows = [header, ["---", "---:"] + ["---:"] * len(peers.METRICS) + ["---", "---"]]
    for engine, row in summary.items():
        cells = [engine, str(row["runs"])]
        for wl, key, _, digits in peers.METRICS:
            scale = 1000 if key == "ttft_s" else 1
            median, best = (row[f"{wl}_{key}"][k] * scale for k in ("median", "best"))
            cells.append(f"{median:.{digits}f} ({best:.{digits}f})")
        cells.append(row.get("w1_greedy_equal_lmengine", "-"))
        cells.append(
            f"{row['others_share_max']:.0%}" + (" (disturbed)" if row["disturbed"] else "")
        )
        rows.append(cells)
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    for engine, row in summary.items():
        if "lmengine_ratio" in row:
            columns = [m[2] for m in peers.METRICS]
            ratios = ", ".join(
                f"{c} {v:.2f}" for c, v in zip(columns, row["lmengine_ratio"].values())
            )
            lines.append(f"\nlmengine / {engine} (above 1: lmengine better): {ratios}")
    return "\n".join(lines)


def versions(args) -> dict:
    """lmengine's commit and the peers' package versions."""

    def run(cmd: list[str]) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True)
        return done.stdout.strip() or done.stderr.strip()[-200:]

    found = {"lmengine_commit": run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"])}
    for python, dist in (
        (args.vllm_python, "vllm-cpu"),
        (args.llamacpp_python, "llama_cpp_python"),
    ):
        if python:
            code = f"import importlib.metadata as m; print(m.version({dist!r}))"
            found[dist] = run([python, "-c", code])
    return found


def parameter_count(folder: Path) -> int:
    from safetensors import safe_open

    count = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return count


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--shape",
        action="append",
        help=f"one of {sorted(SHAPES)}, repeatable or a comma list (default: 1b)",
    )
    p.add_argument(
        "--engines",
        help=f"comma list of {', '.join(ENGINES)} (default: lmengine and every peer whose "
        "python is given)",
    )
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu")
    p.add_argument("--llamacpp-python", help="python of a venv with llama-cpp-python")
    p.add_argument("--rounds", type=int, default=2, help="every engine once per round")
    p.add_argument("--reps", type=int, default=1, help="timed runs per workload and round")
    helps = {
        "w1_prompts": "W1 prompts",
        "w1_new_tokens": "W1 new tokens per prompt",
        "w2_new_tokens": "W2 new tokens",
        "w3_prompts": "W3 prompts",
    }
    for field, text in helps.items():
        defaults = ", ".join(f"{k} {getattr(v.sizes, field)}" for k, v in SHAPES.items())
        p.add_argument("--" + field.replace("_", "-"), type=int, help=f"{text} ({defaults})")
    p.add_argument(
        "--keep-dir",
        type=Path,
        help="where the generated folders and GGUF files stay (default: lmengine's cache, scale/)",
    )
    p.add_argument(
        "--tokenizer",
        help="folder whose tokenizer the models get (default: lmengine's default model)",
    )
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    args = p.parse_args(argv)
    args.shape = [
        s.strip() for given in args.shape or ["1b"] for s in given.split(",") if s.strip()
    ]
    if bad := [s for s in args.shape if s not in SHAPES]:
        p.error(f"--shape {bad}: one of {sorted(SHAPES)}")
    pythons = {"vllm": args.vllm_python, "llamacpp": args.llamacpp_python}
    if args.engines is None:
        args.engines = [e for e in ENGINES if e == "lmengine" or pythons[e.split("-")[0]]]
    else:
        args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        if bad := [e for e in args.engines if e not in ENGINES]:
            p.error(f"--engines {bad}: a comma list of {', '.join(ENGINES)}")
        if missing := [e for e in args.engines if e != "lmengine" and not pythons[e.split("-")[0]]]:
            p.error(f"--engines {missing} need --{missing[0].split('-')[0]}-python")
    for name in ("rounds", "reps", "w1_prompts", "w1_new_tokens", "w3_prompts"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.w2_new_tokens is not None and args.w2_new_tokens < 2:
        p.error("--w2-new-tokens must be >= 2 to measure decode")
    return args


def main(argv: list[str] | None = None) -> int:
    from lmengine.bench.report import cpu_model
    from lmengine.engine.loader import cache_dir, resolve_model_path

    args = parse_args(argv)
    keep_dir = args.keep_dir or cache_dir() / "scale"
    keep_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or resolve_model_path(None)
    fields = WorkloadSizes.__dataclass_fields__
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    out = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
        "versions": versions(args),
        "engines": args.engines,
        "how": {
            "lmengine": "bfloat16, EngineConfig defaults",
            "vllm": f"bfloat16, KV cache {VLLM_KV_GIB} GiB, OpenMP on every core",
            "llamacpp": "batched, every core, AMX repacking "
            + ("on" if os.environ.get("LMENGINE_PEER_LLAMACPP_AMX") == "1" else "off"),
        },
        "rounds": args.rounds,
        "reps": args.reps,
        "shapes": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "workloads.json"
        peers.build_workloads(full)
        for key in args.shape:
            shape = SHAPES[key]
            files = prepare(key, keep_dir, tokenizer)
            sizes = replace(shape.sizes, **given)
            workloads = shape_workloads(json.loads(full.read_text()), sizes)
            wl_path = Path(tmp) / f"workloads-{key}.json"
            wl_path.write_text(json.dumps(workloads))
            runs, failed = [], {}
            for round_ in range(1, args.rounds + 1):
                order = args.engines if round_ % 2 else args.engines[::-1]
                for engine in [e for e in order if e not in failed]:
                    try:
                        result = run_engine(args, engine, files, wl_path, Path(tmp))
                    except RuntimeError as error:  # the other engines still run
                        print(error, file=sys.stderr, flush=True)
                        failed[engine] = str(error)
                        continue
                    runs.append({**result, "round": round_})
            record = {
                "shape": key,
                "name": shape.name,
                "config": json.loads((files["folder"] / "config.json").read_text()),
                "params": parameter_count(files["folder"]),
                "files": {k: str(v) for k, v in files.items()},
                "sizes": asdict(sizes),
                "w2_prompt_tokens": len(workloads["W2"]["prompts"][0]),
                "w3_prompt_tokens": round(statistics.mean(map(len, workloads["W3"]["prompts"]))),
                "summary": summarize(runs) if runs else {},
                "failed": failed,
                "runs": runs,
            }
            out["shapes"].append(record)
            machine = f"{out['cpu']}, {out['cpu_count']} cores, {out['date']}"
            print(report(record, machine) if runs else f"\n{key}: no engine ran", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\n{out['versions']}")
    return 0 if all(not s["failed"] for s in out["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
