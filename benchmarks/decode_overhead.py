"""Per-step overhead of single-stream decode: the time of a step at batch 1 against the time its
bytes take at the machine's measured bandwidth, with the compiled decode loop and without.

    python benchmarks/decode_overhead.py                 # GGUF blocks, bfloat16, float32
    python benchmarks/decode_overhead.py --weights gguf --rounds 3

For each weight format of the default model (the Q4_1 file's blocks, its bfloat16 and float32
expansions), one engine streams one chat prompt x 128 new tokens (EOS ignored) after a
warm-up, alternately with `LMENGINE_DECODE_LOOP=0` (every layer through the patched modules)
and `=1` (models/decode_loop.py: the layers in one native call), best of 3 streams per run.
Reported per format and run: ms per token, the bytes a decode step reads (every linear's
weights or blocks, the LM head, the KV cache at the mean context), the floor those bytes take
at the bandwidth measured once (a 1 GiB sum on every thread, on the first engine's loop thread),
and the overhead: ms per token minus the floor. The floor assumes the weights stream from
memory; a model that fits in the last-level cache reads faster, so for it the overhead is an
upper bound. Refuses a busy machine unless given --force.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 128
CONFIGS = {  # name -> EngineConfig fields
    "gguf": dict(quant_policy="gguf"),
    "bfloat16": dict(dtype="bfloat16", quant_policy="float"),
    "float32": dict(dtype="float32", quant_policy="float"),
}


def bandwidth_gbs() -> float:
    """GB/s of a 1 GiB float32 sum on every thread, best of 5."""
    import torch

    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def step_bytes(model, context: int) -> int:
    """Bytes a one-row decode step reads: every linear's weight (or blocks), the LM head's and
    the K/V of `context` tokens in every layer."""
    from lmengine.models.layers import GGUFLinear, PackedLinear
    from lmengine.quant.gguf import GGUFHead

    total = 0
    for module in model.modules():
        if isinstance(module, GGUFHead):
            total += module.blocks.nbytes
        elif isinstance(module, GGUFLinear):
            total += sum(getattr(module, f"blocks{i}").nbytes for i in range(len(module.qtypes)))
        elif isinstance(module, PackedLinear):
            total += module.weight.nbytes
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_elements = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * context
    total += kv_elements * model.dtype.itemsize
    return total


def measure(name: str, loop: bool, with_bandwidth: bool = False) -> dict:
    from lmengine import Engine, EngineConfig, GenerationConfig
    from lmengine.api import chat_token_ids

    os.environ["LMENGINE_DECODE_LOOP"] = "1" if loop else "0"
    engine = Engine.from_pretrained(None, EngineConfig(**CONFIGS[name]))
    try:
        story = [{"role": "user", "content": "Write a long story about a dragon who cooks."}]
        prompt = chat_token_ids(engine.tokenizer, story)
        inst = engine.create_instance()
        inst.infer(0, prompt, gen_config=GenerationConfig(max_new_tokens=8))
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        best = float("inf")
        for session in (1, 2, 3):
            first = last = None
            for out in inst.stream_infer(session, prompt, gen):
                last = time.perf_counter()
                if first is None:  # the first token: the prompt's prefill ends here
                    first, first_tokens = last, len(out.token_ids)
            # a reply may carry several tokens when the reader falls behind: count tokens
            best = min(best, (last - first) / (len(out.token_ids) - first_tokens))
        model = engine.model_agent.runner.model
        row = {
            "ms_per_token": best * 1e3,
            "step_bytes": step_bytes(model, len(prompt) + NEW_TOKENS // 2),
        }
        if with_bandwidth:
            # NOTE: on the engine's loop thread: a parallel torch op on this thread would leave
            # a second OpenMP pool that slows every later step (docs/performance.md)
            row["bandwidth_gbs"] = engine.call(bandwidth_gbs)
        return row
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/decode_overhead.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--weights", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=2, help="runs of each, order alternating")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--force", action="store_true", help="run even if the CPUs are busy")
    args = p.parse_args(argv)
    from lmengine.bench.report import check_idle, cpu_model

    rows = []
    gbs = None
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for name in args.weights:
            for loop in order:
                check_idle(args.force)
                row = {"weights": name, "loop": loop, "round": round_ + 1}
                row.update(measure(name, loop, with_bandwidth=gbs is None))
                gbs = gbs or row.pop("bandwidth_gbs")
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    for row in rows:
        row["floor_ms"] = row["step_bytes"] / (gbs * 1e9) * 1e3
        row["overhead_ms"] = row["ms_per_token"] - row["floor_ms"]
    print(f"{cpu_model()}, {time.strftime('%Y-%m-%d')}, bandwidth {gbs:.1f} GB/s\n")
    print("| weights | decode loop | round | ms/token | MB/step | floor ms | overhead ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['weights']} | {'on' if r['loop'] else 'off'} | {r['round']} "
            f"| {r['ms_per_token']:.2f} | {r['step_bytes'] / 1e6:.0f} | {r['floor_ms']:.2f} "
            f"| {r['overhead_ms']:.2f} |"
        )
    if args.json:
        info = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "bandwidth_gbs": gbs}
        Path(args.json).write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
