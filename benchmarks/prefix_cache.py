"""Prefix caching on and off, in one run: prompt tokens computed and throughput.

    python benchmarks/prefix_cache.py            # SmolLM2-135M-Instruct, float32, CPU
    python benchmarks/prefix_cache.py --quick    # a smoke test with small sizes

Scenarios (each on a fresh engine per mode, so no scenario warms another's cache):
- w1-chat: the prompts of examples/prompts.txt as chat prompts; they share only the chat
  template's default system prompt. N new tokens each, EOS ignored.
- w1-system: the same with a long shared system prompt (~250 tokens), as chat servers use.
- multi-turn: C conversations of T turns, turns one after another, conversations batched;
  each turn's prompt is the whole history (system prompt, earlier turns and answers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lmengine.api import Pipeline
from lmengine.config import EngineConfig, GenerationConfig
from lmengine.engine.engine import Engine

PROMPTS = Path(__file__).resolve().parent.parent / "examples" / "prompts.txt"
SYSTEM = (
    "You are a helpful, careful and concise assistant deployed by a research lab. Follow "
    "these rules in every answer. Answer the question that was asked and nothing else. Keep "
    "answers short unless the user asks for detail; prefer plain words to jargon. When a "
    "question is ambiguous, state the reading you chose in one sentence and answer it. When "
    "you are not sure, say so, and say what would settle it. Never invent citations, numbers "
    "or quotes. Use metric units. Format lists with dashes and code in fenced blocks with the "
    "language named. Do not repeat the question back. Do not apologise unless you made a "
    "mistake. If the user writes in another language, answer in that language. Be polite but "
    "do not flatter. Refuse requests that could cause harm, briefly and without lecturing, "
    "and offer a safe alternative where one exists. Remember earlier turns of the "
    "conversation and stay consistent with what you said before."
)


def run_scenario(model: str | None, caching: bool, name: str, args) -> dict:
    lines = [x.strip() for x in PROMPTS.read_text().splitlines() if x.strip()]
    cfg = EngineConfig(dtype="float32", device="cpu", enable_prefix_caching=caching)
    engine = Engine.from_pretrained(model, cfg)
    try:
        pipe = Pipeline(engine)
        gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        pipe(["warm up"], gen_config=GenerationConfig(max_new_tokens=2))  # untimed
        s0 = engine.stats()
        prompt_tokens = out_tokens = 0
        t0 = time.perf_counter()
        if name.startswith("w1"):
            msgs = [
                ([{"role": "system", "content": SYSTEM}] if name == "w1-system" else [])
                + [{"role": "user", "content": lines[i % len(lines)]}]
                for i in range(args.num_prompts)
            ]
            for r in pipe(msgs, gen_config=gen):
                prompt_tokens += r.input_token_len
                out_tokens += r.generate_token_len
        else:
            chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.num_conversations)]
            for turn in range(args.num_turns):
                for c, chat in enumerate(chats):
                    q = lines[(c * args.num_turns + turn) % len(lines)]
                    chat.append({"role": "user", "content": q})
                for chat, r in zip(chats, pipe([list(c) for c in chats], gen_config=gen)):
                    chat.append({"role": "assistant", "content": r.text})
                    prompt_tokens += r.input_token_len
                    out_tokens += r.generate_token_len
        dt = time.perf_counter() - t0
        s1 = engine.stats()
        engine.check_integrity()
    finally:
        engine.close()
    return {
        "seconds": dt,
        "prompt_tokens": prompt_tokens,
        "computed": s1["num_computed_prompt_tokens"] - s0["num_computed_prompt_tokens"],
        "cached": s1["num_prefix_cached_tokens"] - s0["num_prefix_cached_tokens"],
        "out_tok_s": out_tokens / dt,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/prefix_cache.py", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--scenarios", default="w1-chat,w1-system,multi-turn")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens = 8, 8
        args.num_conversations, args.num_turns = 3, 3
    print(f"# {' '.join(sys.argv)}")
    header = (
        "| scenario | prefix cache | prompt tokens | computed | from cache | seconds | out tok/s |"
    )
    print(header + "\n|---|---|---:|---:|---:|---:|---:|")
    for name in args.scenarios.split(","):
        res = {c: run_scenario(args.model, c, name, args) for c in (False, True)}
        for c in (False, True):
            r = res[c]
            print(
                f"| {name} | {'on' if c else 'off'} | {r['prompt_tokens']} | {r['computed']} | "
                f"{r['cached']} | {r['seconds']:.2f} | {r['out_tok_s']:.1f} |"
            )
        off, on = res[False], res[True]
        print(
            f"| {name} | on/off | | {on['computed'] / max(1, off['computed']):.2f}x | | "
            f"{off['seconds'] / on['seconds']:.2f}x faster | "
            f"{on['out_tok_s'] / off['out_tok_s']:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
