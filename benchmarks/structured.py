"""Structured outputs, measured: W1 with every request constrained by a JSON schema against
the same requests unconstrained, in one run on an idle machine.

    python benchmarks/structured.py            # SmolLM2-135M-Instruct, 64 chat prompts
    python benchmarks/structured.py --quick    # a smoke test with small sizes

First every W1 prompt (`--num-prompts` chat prompts asking for a JSON description) runs
constrained by a moderately complex schema (nested object, enum, array of enums, bounded
strings, integer, boolean), up to `--max-new-tokens`; then, alternated `--repeat` times, the
same prompts unconstrained with each request's `max_new_tokens` set to the length its
constrained twin produced (EOS ignored), and constrained again: both runs decode the same
number of tokens per request, so the difference is the grammar's cost (mask filling, bitmask
application, matcher updates). Also reports the time to compile the schema cold and warm
(xgrammar's cache) and how many outputs parse and validate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from lmengine import Engine, EngineConfig, GenerationConfig, Pipeline
from lmengine.bench.prompts import read_lines

sys.path.insert(0, str(Path(__file__).resolve().parent))
from research import report_header, write_report  # noqa: E402

from lmengine.bench.report import check_idle  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "lmengine" / "data" / "prompts.txt"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "category": {"enum": ["science", "history", "art", "technology", "other"]},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "answer": {
            "type": "object",
            "properties": {
                "summary": {"type": "string", "maxLength": 120},
                "confident": {"type": "boolean"},
            },
            "required": ["summary", "confident"],
        },
    },
    "required": ["title", "category", "difficulty", "keywords", "answer"],
}


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        set(SCHEMA["required"]) <= set(obj)
        and obj["category"] in SCHEMA["properties"]["category"]["enum"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.repeat = 8, 60, 1
    check_idle(args.force or args.quick)
    report = report_header()
    engine = Engine.from_pretrained(args.model, EngineConfig(dtype="float32", device="cpu"))
    try:
        pipe = Pipeline(engine)
        lines = read_lines(str(PROMPTS))
        prompts = [
            f"Describe this question as JSON: {lines[i % len(lines)]}"
            for i in range(args.num_prompts)
        ]
        t0 = time.perf_counter()
        engine._compile_grammar({"json": SCHEMA})
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine._compile_grammar({"json": SCHEMA})
        warm = time.perf_counter() - t0
        constrained = GenerationConfig(
            max_new_tokens=args.max_new_tokens, structured_outputs={"json": SCHEMA}
        )
        first = pipe(prompts, gen_config=constrained)
        lengths = [r.generate_token_len for r in first]
        twins = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in lengths]
        times: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        for r in range(args.repeat):
            for name, cfg in (("unconstrained", twins), ("constrained", constrained)):
                t0 = time.perf_counter()
                outs = pipe(prompts, gen_config=cfg)
                times[name].append(time.perf_counter() - t0)
                assert [o.generate_token_len for o in outs] == lengths, name
                print(f"repeat {r}: {name} {sum(lengths) / times[name][-1]:.1f} tok/s",
                      file=sys.stderr, flush=True)  # fmt: skip
        rates = {k: sum(lengths) / statistics.median(v) for k, v in times.items()}
        report.update(
            num_prompts=len(prompts),
            output_tokens=sum(lengths),
            finished_by_grammar=sum(r.finish_reason == "stop" for r in first),
            valid_outputs=sum(valid(r.text) for r in first if r.finish_reason == "stop"),
            compile_s={"cold": cold, "warm (cached)": warm},
            output_tokens_per_s=rates,
            constrained_cost=1 - rates["constrained"] / rates["unconstrained"],
            times_s=times,
        )
    finally:
        engine.close()
    write_report(report, args.out)


if __name__ == "__main__":
    main()
