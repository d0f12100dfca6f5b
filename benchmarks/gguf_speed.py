"""The default model on its GGUF blocks (`quant_policy="gguf"`) against its float32 expansion.

    python benchmarks/gguf_speed.py              # two rounds, float32 and Q4_1 alternating
    python benchmarks/gguf_speed.py --rounds 1 --force

Each run is its own engine: one chat prompt x 128 new tokens streamed after a warm-up (decode
tok/s, best of three), then 64 chat prompts x 64 new tokens submitted at once (output tok/s).
Refuses a busy machine unless given --force.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(quant_policy: str) -> tuple[float, float]:
    from lmengine import Engine, EngineConfig, GenerationConfig
    from lmengine.api import chat_token_ids

    engine = Engine.from_pretrained(None, EngineConfig(quant_policy=quant_policy))
    try:
        tok = engine.tokenizer
        story = [{"role": "user", "content": "Write a long story about a dragon who cooks."}]
        prompt = chat_token_ids(tok, story)
        inst = engine.create_instance()
        inst.infer(0, prompt, gen_config=GenerationConfig(max_new_tokens=8))
        gen = GenerationConfig(max_new_tokens=128, ignore_eos=True)
        decode = 0.0
        for session in (1, 2, 3):
            first = None
            for out in inst.stream_infer(session, prompt, gen_config=gen):
                last = time.perf_counter()
                if first is None:
                    first, first_tokens = last, len(out.token_ids)
            # tokens, not replies: a reply carries several when the reader falls behind
            decode = max(decode, (len(out.token_ids) - first_tokens) / (last - first))
        lines = (ROOT / "examples" / "prompts.txt").read_text().splitlines()
        prompts = [
            chat_token_ids(tok, [{"role": "user", "content": lines[i % len(lines)]}])
            for i in range(64)
        ]
        batch_gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
        generated = [0] * len(prompts)

        def one(i: int) -> None:
            r = engine.create_instance().infer(100 + i, prompts[i], gen_config=batch_gen)
            generated[i] = r.generate_token_len

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return decode, sum(generated) / (time.perf_counter() - start)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/gguf_speed.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    args = p.parse_args(argv)
    from lmengine.bench.report import check_idle, cpu_model

    rows = []
    for round_ in range(1, args.rounds + 1):
        for policy in ("float", "gguf"):
            check_idle(args.force)
            decode, batch = measure(policy)
            name = "Q4_1 blocks" if policy == "gguf" else "float32 expansion"
            rows.append((round_, name, decode, batch))
            print(f"round {round_} {name}: {decode:.1f} / {batch:.1f} tok/s", file=sys.stderr)
    print(f"{cpu_model()}, {time.strftime('%Y-%m-%d')}\n")
    print("| round | weights | single-stream decode tok/s | 64 x 64 batch tok/s |")
    print("| --- | --- | ---: | ---: |")
    for round_, name, decode, batch in rows:
        print(f"| {round_} | {name} | {decode:.1f} | {batch:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
