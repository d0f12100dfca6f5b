"""w8a8 on bfloat16 activations against plain bfloat16 and w8a8 in float32, same run.

    python benchmarks/w8a8_bf16.py --float MODEL_DIR --w8a8 W8A8_DIR [--rounds 2] [--reps 3]

1. Prefill: one step of 4 prompts x 1,016 tokens (W3's shape), tokens/s, best of `--reps`
   after a warm-up; each engine in a fresh process (see w8a8.py), taking turns per round:
   the float checkpoint in bfloat16, the w8a8 checkpoint in bfloat16 and in float32.
2. GEMMs of the model's shapes at 1, 2, 16, 64 and 4,064 rows, 2 threads, wall microseconds
   (best of interleaved repeats): bfloat16 (`linear`: GEMV, oneDNN on AMX), w8a8 in float32
   (oneDNN's packed int8 weight, the float32 model's path), w8a8 in bfloat16 on oneDNN's packed
   weight and on the AMX-INT8 tiles (`pack_int8_weight_amx`), each with its per-token
   quantization and epilogue.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

PROMPTS, PROMPT_LEN = 4, 1016
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def prefill_here(path: str, dtype: str, reps: int) -> float:
    """Prefill tokens/s of one engine in this process."""
    from lmengine import Engine, EngineConfig, GenerationConfig
    from lmengine.api import Pipeline

    ids = [[(t * 7 + i * 13) % 40000 + 100 for t in range(PROMPT_LEN)] for i in range(PROMPTS)]
    gen = GenerationConfig(max_new_tokens=1, ignore_eos=True)
    config = EngineConfig(dtype=dtype, device="cpu", max_prefill_token_num=PROMPTS * PROMPT_LEN)
    with Engine.from_pretrained(path, config) as engine:
        pipe = Pipeline(engine)
        pipe(ids[:1], gen_config=gen)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            pipe(ids, gen_config=gen)
            best = min(best, time.perf_counter() - t0)
    return PROMPTS * PROMPT_LEN / best


def _best_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _gemm_calls(m: int, n: int, k: int) -> dict:
    """The variants of one [m, k] x [k, n] linear, each a callable."""
    from lmengine.kernels.linear import linear, pack_weight
    from lmengine.kernels.w8a8 import (
        int8_gemm,
        pack_int8_weight,
        pack_int8_weight_amx,
        per_token_quant,
    )
    from lmengine.models.w8a8 import quantize_weight

    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(m + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    w_q, w_s = quantize_weight(w)
    w_p, w_a = pack_int8_weight(w_q), pack_int8_weight_amx(w_q)
    w_b, x_b = w.to(bf16), x.to(bf16)
    p_b = pack_weight(w_b)
    calls = {
        "bf16": lambda: linear(x_b, w_b, None, p_b),
        "w8a8_f32": lambda: int8_gemm(*per_token_quant(x), w_q, w_s, packed=w_p),
        "w8a8_bf16_onednn": lambda: int8_gemm(
            *per_token_quant(x_b), w_q, w_s, None, bf16, packed=w_p
        ),
    }
    if w_a is not None:
        calls["w8a8_bf16_amx"] = lambda: int8_gemm(
            *per_token_quant(x_b), w_q, w_s, None, bf16, packed_amx=w_a
        )
    return calls


def gemm_rows(rows: list[int], reps: int) -> list[dict]:
    out = []
    for m in rows:
        for name, (n, k) in SHAPES.items():
            calls = _gemm_calls(m, n, k)
            best = {c: float("inf") for c in calls}
            for _ in range(3):  # interleaved: every variant sees the same machine
                for c, fn in calls.items():
                    best[c] = min(best[c], _best_us(fn, reps))
            out.append(dict(rows=m, linear=name, **best))
            print(m, name, " ".join(f"{c}={v:.0f}" for c, v in best.items()), file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--float", dest="float_path", required=True)
    parser.add_argument("--w8a8", dest="w8a8_path", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gemm-rows", default="1,2,16,64,4064")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # path dtype reps (child)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(prefill_here(args.one[0], args.one[1], int(args.one[2]))))
        return
    engines = {
        "bf16": (args.float_path, "bfloat16"),
        "w8a8_bf16": (args.w8a8_path, "bfloat16"),
        "w8a8_f32": (args.w8a8_path, "float32"),
    }
    prefill: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, (path, dtype) in engines.items():
            cmd = [sys.executable, __file__, "--float", "-", "--w8a8", "-"]
            cmd += ["--one", path, dtype, str(args.reps)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            prefill[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(name, f"{prefill[name][-1]:.0f} tok/s", file=sys.stderr)
    rows = [int(r) for r in args.gemm_rows.split(",")]
    result = {"prefill_tok_s": prefill, "gemm_us": gemm_rows(rows, 10)}
    best = {name: max(v) for name, v in prefill.items()}
    print(json.dumps(result, indent=1))
    print(
        f"prefill tok/s (best round): bf16 {best['bf16']:.0f}, w8a8 bf16 {best['w8a8_bf16']:.0f}"
        f" ({best['w8a8_bf16'] / best['bf16']:.2f}x), w8a8 f32 {best['w8a8_f32']:.0f}"
    )


if __name__ == "__main__":
    main()
