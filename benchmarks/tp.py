"""Tensor parallelism: tp=1 against tp=2 on W1 (offline batch), in one run.

    python benchmarks/tp.py [--quick] [--model FOLDER]

W1 as in `lmengine bench`: chat prompts of examples/prompts.txt submitted at once, N new
tokens each, EOS ignored. For each tp: output tokens/s, mean step time (the ModelAgent's
forward on rank 0: broadcast, shard forward, logit gather, sampling), and, from the torch
profiler on rank 0 over a separate run, the share of the step spent in collectives
(broadcast of the inputs, all-reduces, logit gather; waiting for the slower rank included).

The default model is SmolLM2-135M's shape with random weights and 8 heads / 4 KV heads
(the real SmolLM2-135M has 9 heads, which 2 ranks cannot split). On a machine with 2 cores
the two ranks share them: this measures the overhead of the machinery, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmengine import Engine, EngineConfig, GenerationConfig  # noqa: E402
from lmengine.engine.loader import resolve_model_path  # noqa: E402


def make_model(folder: Path) -> str:
    """SmolLM2-135M's shape, random weights, 8 heads / 4 KV heads, SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(src)
    config = LlamaConfig.from_pretrained(src)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 72
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def w1_prompts(path: str, num_prompts: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = [x for x in (ROOT / "examples" / "prompts.txt").read_text().splitlines() if x.strip()]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": lines[i % len(lines)]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(num_prompts)
    ]


def run_batch(engine: Engine, prompts: list[list[int]], new: int) -> float:
    """Submit every prompt at once; seconds until the last one finishes."""
    import threading

    gen = GenerationConfig(max_new_tokens=new, ignore_eos=True)
    results = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = engine.create_instance().infer(i, prompts[i], gen_config=gen)

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    bad = [r for r in results if r.finish_reason != "length" or r.generate_token_len != new]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0].error}")
    return elapsed


def timed_steps(engine: Engine) -> list[float]:
    """Wrap the agent's forward to record each step's duration (loop thread only)."""
    agent, durations = engine.model_agent, []
    forward = agent.forward

    def timed(out):
        t = time.perf_counter()
        try:
            return forward(out)
        finally:
            durations.append(time.perf_counter() - t)

    agent.forward = timed
    return durations


def comm_share(engine: Engine, prompts: list[list[int]], new: int) -> float:
    """Fraction of rank 0's step time spent in collectives, from the torch profiler.

    Each collective call (broadcast, all_reduce, gather) is marked with a record_function
    for this run, so its event spans the call and the wait for the other ranks."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    agent = engine.model_agent
    forward = agent.forward
    originals = {name: getattr(dist, name) for name in ("broadcast", "all_reduce", "gather")}

    def marked(out):
        with record_function("lmengine_step"):
            return forward(out)

    def wrap(fn):
        def collective(*args, **kwargs):
            with record_function("lmengine_collective"):
                return fn(*args, **kwargs)

        return collective

    agent.forward = marked
    prof = profile(activities=[ProfilerActivity.CPU])
    engine.call(prof.__enter__)  # NOTE: the profiler records the thread that starts it
    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        run_batch(engine, prompts, new)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        engine.call(lambda: prof.__exit__(None, None, None))
        agent.forward = forward
    events = {e.key: e.cpu_time_total for e in prof.key_averages()}
    step, comm = events.get("lmengine_step", 0.0), events.get("lmengine_collective", 0.0)
    return comm / step if step else float("nan")


def measure(path: str, tp: int, prompts, new: int, repeat: int, threads: int) -> dict:
    cfg = EngineConfig(tp=tp, max_batch_size=len(prompts), num_threads=threads)
    engine = Engine.from_pretrained(path, cfg)
    try:
        run_batch(engine, prompts[:2], 4)  # warm-up
        steps = timed_steps(engine)
        walls = [run_batch(engine, prompts, new) for _ in range(repeat)]
        best = min(walls)
        result = {
            "tp": tp,
            "tok_s": len(prompts) * new / best,
            "wall_s": best,
            "step_ms": 1000 * statistics.mean(steps),
            "steps": len(steps) // repeat,
        }
        engine.model_agent.forward = engine.model_agent.__class__.forward.__get__(
            engine.model_agent
        )
        result["comm_share"] = comm_share(engine, prompts, new) if tp > 1 else 0.0
        return result
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, 1 run")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: see above)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 32 (quick: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (quick 16)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs (default 3, quick 1)")
    parser.add_argument("--tp", type=int, default=2, help="the tp compared with tp=1")
    args = parser.parse_args()
    num_prompts = args.num_prompts or (8 if args.quick else 32)
    new = args.max_new_tokens or (16 if args.quick else 64)
    repeat = args.repeat or (1 if args.quick else 3)
    cores = os.cpu_count() or 1
    # NOTE: each rank gets cores / tp threads; tp=1 runs both with all cores (its normal
    # setting) and with cores / tp threads (the same compute per rank as tp=N)
    configs = [(1, cores)]
    if cores // args.tp != cores:
        configs.append((1, max(1, cores // args.tp)))
    configs.append((args.tp, max(1, cores // args.tp)))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_model(Path(tmp) / "model")
        prompts = w1_prompts(path, num_prompts)
        rows = [measure(path, tp, prompts, new, repeat, threads=t) for tp, t in configs]
    base = rows[0]["tok_s"]
    print(f"\nW1: {num_prompts} prompts x {new} new tokens, {cores} cores, best of {repeat}")
    print(
        "| tp | threads per rank | output tok/s | vs first row | mean step ms | steps "
        "| collectives' share of step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r, (_, threads) in zip(rows, configs):
        share = f"{100 * r['comm_share']:.0f} %" if r["tp"] > 1 else "-"
        print(
            f"| {r['tp']} | {threads} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x "
            f"| {r['step_ms']:.1f} | {r['steps']} | {share} |"
        )


if __name__ == "__main__":
    main()
