"""Research hooks, measured: scoring throughput against lm-evaluation-harness' `hf` backend,
and what reading hidden states or steering costs a generation workload. One run, systems
interleaved, on an idle machine.

    python benchmarks/research.py                 # both parts, SmolLM2-135M-Instruct, CPU
    python benchmarks/research.py --part scoring  # --num-pairs 1000 --hf-batch-size 32
    python benchmarks/research.py --part overhead # W1: 64 chat prompts x 128 tokens
    python benchmarks/research.py --quick         # a smoke test with small sizes

scoring: `--num-pairs` (context, continuation) pairs of ~`--pair-tokens` tokens cut from the
held-out text (contexts of 80 %, continuations of 20 %), in two shapes: independent pairs,
and multiple choice (`--num-choices` continuations per context, as lm-eval's log-likelihood
tasks ask). Scored by `Pipeline.score` (prefix caching on) and by lm-eval's
`HFLM.loglikelihood` (float32, `--hf-batch-size`, its own length sorting and padding) on the
same checkpoint; both on the engine's thread (one OpenMP pool), alternated `--repeat` times.
Reports pairs/s of each, the ratio, and the largest difference between their
log-likelihoods.

overhead: W1 generation (`--num-prompts` chat prompts x `--new-tokens`, EOS ignored) plain,
with every request reading one layer's hidden states (`--layer`, every position), and with
every request steered by one vector at that layer; alternated `--repeat` times. Reports
output tokens/s of each and the cost relative to plain.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from lmengine.api import Pipeline
from lmengine.bench.prompts import chat_ids, read_lines
from lmengine.bench.report import busy_fraction, check_idle, cpu_model
from lmengine.config import EngineConfig, GenerationConfig, SteeringVector
from lmengine.engine.engine import Engine
from lmengine.engine.loader import resolve_model_path
from lmengine.quant.eval import heldout_token_ids

PROMPTS = Path(__file__).resolve().parents[1] / "lmengine" / "data" / "prompts.txt"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def report_header() -> dict:
    """What every report of a run starts with: the CPU, the date, how busy the machine was."""
    return {
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "loadavg_at_start": list(os.getloadavg()),
        "busy_fraction_at_start": round(busy_fraction(), 3),
        "torch_threads": torch.get_num_threads(),
    }


def write_report(report: dict, out: str | None) -> None:
    """The report as JSON on stdout, and into `out` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def make_pairs(
    tokenizer, num_pairs: int, pair_tokens: int, num_choices: int, seed: int
) -> list[tuple[str, str]]:
    """(context, continuation) texts cut from the held-out text at random token offsets;
    `num_choices` consecutive pairs share a context (1: every pair its own)."""
    ids = heldout_token_ids(tokenizer)
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < num_pairs:
        n = rng.randint(int(0.8 * pair_tokens), int(1.2 * pair_tokens))
        start = rng.randrange(0, len(ids) - n)
        cut = start + int(0.8 * n)
        context = tokenizer.decode(ids[start:cut])
        length = start + n - cut
        # the true continuation, then spans of the same length from elsewhere (distractors)
        offsets = [cut] + [rng.randrange(0, len(ids) - length) for _ in range(num_choices - 1)]
        pairs += [(context, tokenizer.decode(ids[o : o + length])) for o in offsets]
    return pairs[:num_pairs]


def scoring(engine: Engine, hf, pairs: list[tuple[str, str]], args) -> dict:
    from lm_eval.api.instance import Instance

    pipe = Pipeline(engine)
    instances = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]

    def run_lm() -> tuple[float, list[float]]:
        engine.reset_prefix_cache()  # NOTE: no run reuses the blocks of an earlier one
        t0 = time.perf_counter()
        scores = pipe.score(pairs)
        return time.perf_counter() - t0, [s.sum_logprob for s in scores]

    def run_hf() -> tuple[float, list[float]]:
        def work():
            t0 = time.perf_counter()
            out = hf.loglikelihood(instances, disable_tqdm=True)
            return time.perf_counter() - t0, [lp for lp, _ in out]

        return engine.call(work, timeout=None)

    times: dict[str, list[float]] = {"lmengine": [], "lm-eval hf": []}
    results = {}
    for r in range(args.repeat):
        for name, fn in (("lmengine", run_lm), ("lm-eval hf", run_hf)):
            dt, lls = fn()
            times[name].append(dt)
            results[name] = lls
            log(f"scoring repeat {r}: {name} {dt:.1f} s ({len(pairs) / dt:.1f} pairs/s)")
    diff = max(abs(a - b) for a, b in zip(results["lmengine"], results["lm-eval hf"]))
    num_tokens = sum(len(engine.tokenizer(c + x)["input_ids"]) for c, x in pairs)
    rows = {name: len(pairs) / statistics.median(ts) for name, ts in times.items()}
    return {
        "num_pairs": len(pairs),
        "mean_tokens_per_pair": num_tokens / len(pairs),
        "hf_batch_size": args.hf_batch_size,
        "pairs_per_s": rows,
        "times_s": times,
        "ratio": rows["lmengine"] / rows["lm-eval hf"],
        "max_abs_loglikelihood_diff": diff,
    }


def overhead(engine: Engine, args) -> dict:
    lines = read_lines(str(PROMPTS))
    prompts = [chat_ids(engine.tokenizer, lines[i % len(lines)]) for i in range(args.num_prompts)]
    hidden = engine.info.hidden_size
    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
    base = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    modes = {
        "plain": GenerationConfig(**base),
        f"hidden states of layer {args.layer}": GenerationConfig(
            **base, output_hidden_states=(args.layer,)
        ),
        f"steering at layer {args.layer}": GenerationConfig(
            **base, steering={args.layer: SteeringVector(vector, scale=0.5)}
        ),
    }
    pipe = Pipeline(engine)
    times: dict[str, list[float]] = {name: [] for name in modes}
    for r in range(args.repeat):
        for name, cfg in modes.items():
            t0 = time.perf_counter()
            outs = pipe(prompts, gen_config=cfg)
            dt = time.perf_counter() - t0
            assert all(o.generate_token_len == args.new_tokens for o in outs), name
            times[name].append(dt)
            log(f"overhead repeat {r}: {name} {len(prompts) * args.new_tokens / dt:.1f} tok/s")
    rates = {
        name: len(prompts) * args.new_tokens / statistics.median(ts) for name, ts in times.items()
    }
    plain = rates["plain"]
    return {
        "num_prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "output_tokens_per_s": rates,
        "cost_vs_plain": {name: 1 - rate / plain for name, rate in rates.items()},
        "times_s": times,
    }


def scoring_shapes(path: str, args) -> dict:
    """Both pair shapes on one engine (prefix caching on) and one lm-eval HFLM."""
    from lm_eval.models.huggingface import HFLM

    cfg = EngineConfig(dtype="float32", device="cpu", enable_prefix_caching=True)
    engine = Engine.from_pretrained(path, cfg)
    try:
        hf = engine.call(
            lambda: HFLM(
                pretrained=path, dtype="float32", device="cpu", batch_size=args.hf_batch_size
            ),
            timeout=None,
        )
        out = {}
        for shape, choices in (("independent pairs", 1), ("multiple choice", args.num_choices)):
            pairs = make_pairs(engine.tokenizer, args.num_pairs, args.pair_tokens, choices, 0)
            out[shape] = scoring(engine, hf, pairs, args)
        return out
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2)")
    parser.add_argument("--part", choices=["scoring", "overhead", "both"], default="both")
    parser.add_argument("--num-pairs", type=int, default=1000)
    parser.add_argument("--pair-tokens", type=int, default=100)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--num-choices", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--force", action="store_true", help="run on a busy machine")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.num_pairs, args.num_prompts, args.new_tokens, args.repeat = 40, 8, 16, 1
    check_idle(args.force or args.quick)
    path = resolve_model_path(args.model)
    report = report_header()
    if args.part in ("scoring", "both"):
        report["scoring"] = scoring_shapes(path, args)
    if args.part in ("overhead", "both"):
        engine = Engine.from_pretrained(path, EngineConfig(dtype="float32", device="cpu"))
        try:
            report["overhead"] = overhead(engine, args)
        finally:
            engine.close()
    write_report(report, args.out)


if __name__ == "__main__":
    main()
