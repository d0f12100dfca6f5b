"""Serve several peft LoRA adapters from one base model, mixed in one batch.

    python examples/multi_lora.py NAME=/path/to/peft-folder [NAME=/path ...]

Each prompt runs once on the base model and once per adapter, all submitted together.
"""

from __future__ import annotations

import sys

from lmengine import EngineConfig, GenerationConfig, pipeline


def main(argv: list[str]) -> int:
    adapters = dict(arg.split("=", 1) for arg in argv)
    if not adapters:
        print(__doc__)
        return 2
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    names: list[str | None] = [None, *adapters]
    batch = [p for p in prompts for _ in names]
    which = [n for _ in prompts for n in names]
    cfg = EngineConfig(adapters=adapters, max_lora_slots=max(1, len(adapters)))
    with pipeline(engine_config=cfg) as pipe:
        outs = pipe(batch, gen_config=GenerationConfig(max_new_tokens=48), adapter_name=which)
        for prompt, name, out in zip(batch, which, outs):
            print(f"[{name or 'base'}] {prompt}\n  {out.text or out.error}\n")
        print(pipe.engine.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
