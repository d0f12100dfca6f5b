"""Beam search: lmengine against transformers `generate(num_beams=k)`, in one run.

    python benchmarks/beam_search.py            # SmolLM2-135M-Instruct, float32, CPU
    python benchmarks/beam_search.py --quick    # a smoke test with small sizes

For each k: the chat prompts of examples/prompts.txt, N new tokens, EOS ignored (every beam
runs to the end, so both sides do the same work). lmengine runs them as one batch;
transformers runs them one prompt at a time (its beam search is exact only without padding)
and, for its best throughput, as one left-padded batch. Reported: wall time and output
tokens/s (best beam's tokens), how many lmengine outputs equal the one-at-a-time transformers
outputs, and the KV sharing counters (blocks taken by reference at forks vs partial blocks
copied) with the peak device blocks in use against what unshared beams would hold.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from lmengine.api import Pipeline
from lmengine.config import EngineConfig, GenerationConfig
from lmengine.engine.engine import Engine

PROMPTS = Path(__file__).resolve().parent.parent / "examples" / "prompts.txt"


def run_lmengine(engine: Engine, prompts: list[list[int]], gen: GenerationConfig) -> dict:
    pipe = Pipeline(engine)
    bs = engine.engine_config.block_size
    before = engine.stats()
    engine.call(lambda: setattr(engine.beam_search, "peak_blocks_in_use", 0))
    t0 = time.perf_counter()
    outs = pipe(prompts, gen_config=gen)
    dt = time.perf_counter() - t0
    engine.check_integrity()
    after = {**engine.stats(), "peak_blocks_in_use": engine.beam_search.peak_blocks_in_use}
    # unshared: every beam holds all of its blocks, prompt included
    unshared = sum(gen.num_beams * -(-(len(p) + gen.max_new_tokens) // bs) for p in prompts)
    return {
        "seconds": dt,
        "tokens": [o.token_ids for o in outs],
        "out_tok_s": sum(len(o.token_ids) for o in outs) / dt,
        "forks": after["num_forks"] - before["num_forks"],
        "shared": after["num_shared_blocks"] - before["num_shared_blocks"],
        "copied": after["num_cow_copies"] - before["num_cow_copies"],
        "peak_blocks": after["peak_blocks_in_use"],
        "unshared_blocks": unshared,
    }


def run_hf(engine, model, prompts: list[list[int]], gen: GenerationConfig, batched: bool):
    """transformers on the engine's loop thread (between steps, the engine idle): a second
    thread running torch ops would own a second OpenMP pool and slow both (see
    `Systems.on_engine_thread` in lmengine/bench/systems.py)."""
    return engine.call(lambda: _run_hf(model, engine.tokenizer, prompts, gen, batched), None)


def _run_hf(model, tokenizer, prompts: list[list[int]], gen: GenerationConfig, batched: bool):
    kwargs = dict(
        max_new_tokens=gen.max_new_tokens,
        min_new_tokens=gen.max_new_tokens,  # EOS ignored, as on the lmengine side
        num_beams=gen.num_beams,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    t0 = time.perf_counter()
    tokens = []
    with torch.inference_mode():
        if batched:
            width = max(len(p) for p in prompts)
            pad = kwargs["pad_token_id"]
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(ids, attention_mask=mask, **kwargs)
            tokens = [row[width:].tolist() for row in out]
        else:
            for p in prompts:
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                tokens.append(out[0, len(p) :].tolist())
    dt = time.perf_counter() - t0
    return {"seconds": dt, "tokens": tokens, "out_tok_s": sum(map(len, tokens)) / dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/beam_search.py", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-beams", default="2,4", help="comma-separated beam widths")
    p.add_argument("--no-hf-batched", action="store_true", help="skip the padded HF batch")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.num_beams = 2, 8, "2"
    from transformers import AutoModelForCausalLM

    lines = [x.strip() for x in PROMPTS.read_text().splitlines() if x.strip()]
    engine = Engine.from_pretrained(args.model, EngineConfig(dtype="float32", device="cpu"))
    try:
        pipe = Pipeline(engine)
        prompts = [pipe.encode(lines[i % len(lines)]) for i in range(args.num_prompts)]
        model = engine.call(
            lambda: AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32),
            None,
        ).eval()
        print(f"# {' '.join(sys.argv)}")
        print(
            "| k | lmengine s | lmengine out tok/s | HF one-by-one s | HF batched s | "
            "lmengine / HF best | equal to HF | forks | blocks shared / copied | "
            "peak blocks (unshared) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for k in (int(x) for x in args.num_beams.split(",")):
            gen = GenerationConfig(
                num_beams=k,
                max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens,
            )
            pipe(prompts[:1], gen_config=GenerationConfig(max_new_tokens=2))  # warm up
            ours = run_lmengine(engine, prompts, gen)
            hf = run_hf(engine, model, prompts, gen, batched=False)
            hf_b = None if args.no_hf_batched else run_hf(engine, model, prompts, gen, True)
            best_hf = min(hf["seconds"], hf_b["seconds"] if hf_b else float("inf"))
            equal = sum(a == b for a, b in zip(ours["tokens"], hf["tokens"]))
            print(
                f"| {k} | {ours['seconds']:.2f} | {ours['out_tok_s']:.1f} | {hf['seconds']:.2f} | "
                f"{hf_b['seconds'] if hf_b else float('nan'):.2f} | "
                f"{best_hf / ours['seconds']:.2f}x | {equal}/{len(prompts)} | {ours['forks']} | "
                f"{ours['shared']} / {ours['copied']} | "
                f"{ours['peak_blocks']} ({ours['unshared_blocks']}) |",
                flush=True,
            )
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
