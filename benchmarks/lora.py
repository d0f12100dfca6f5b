"""Multi-LoRA throughput: lmengine serving 0/1/4/16/64 distinct adapters against the base model
alone and against peft, all in one run.

    python benchmarks/lora.py                # 64 W1 prompts x 64 new tokens, 0/1/4/16/64 adapters
    python benchmarks/lora.py --quick        # a smoke test: 8 prompts x 8 tokens, 0/1/4/8
    python benchmarks/lora.py --adapters 16 --max-lora-slots 4   # more adapters than slots

Work: the W1 chat prompts of examples/prompts.txt, submitted at once, N new tokens each with EOS
ignored; with k adapters, prompt i uses adapter i mod k. Adapters: random peft LoRAs of rank 8
and 16 (alternating) on q/k/v/o_proj, made with get_peft_model and saved with save_pretrained.

Systems, same model (SmolLM2-135M-Instruct by default), float32 on the CPU:
- lmengine base: an engine without any adapter (the reference throughput);
- lmengine k adapters: one engine holding every adapter (pool sized by --max-lora-slots);
- peft: unmerged `PeftModel` with every adapter loaded, one adapter active at a time, each
  adapter's prompts as one left-padded `generate` batch (k = 0: plain transformers).
Output tokens/s; the table gives the ratio to lmengine base and to peft for each k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def log(msg: str) -> None:
    print(f"[lora-bench] {msg}", file=sys.stderr, flush=True)


def make_adapters(base_path: str, num: int, out_dir: Path) -> dict[str, str]:
    """`num` random peft LoRA folders, ranks 8 and 16 alternating."""
    from lmengine.bench.adapters import save_random_lora

    paths = {}
    for i in range(num):
        rank = 8 if i % 2 == 0 else 16
        paths[f"lora{i}"] = save_random_lora(
            base_path, out_dir / f"lora{i}", seed=i, r=rank, lora_alpha=2 * rank,
            target_modules=TARGETS,
        )  # fmt: skip
    return paths


def adapter_names(num_adapters: int, num_prompts: int) -> list[str | None]:
    if num_adapters == 0:
        return [None] * num_prompts
    return [f"lora{i % num_adapters}" for i in range(num_prompts)]


def run_lmengine(engine, ids: list[list[int]], names: list[str | None], new: int) -> float:
    from lmengine.api import Pipeline
    from lmengine.config import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = Pipeline(engine)(ids, gen_config=cfg, adapter_name=names)
    dt = time.perf_counter() - t0
    bad = [o for o in outs if o.finish_reason == "error" or o.generate_token_len != new]
    if bad:
        raise RuntimeError(f"lmengine: {bad[0].finish_reason} {bad[0].error}")
    return dt


def run_peft(model, tokenizer, ids, names, new: int) -> float:
    """Each adapter's prompts as one left-padded generate batch, one adapter at a time."""
    import torch

    groups: dict[str | None, list[list[int]]] = {}
    for x, name in zip(ids, names):
        groups.setdefault(name, []).append(x)
    t0 = time.perf_counter()
    for name, group in groups.items():
        enc = tokenizer.pad({"input_ids": group}, padding=True, return_tensors="pt")
        kwargs = dict(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        with torch.inference_mode():
            if name is None:
                with model.disable_adapter():
                    model.generate(**kwargs)
            else:
                model.set_adapter(name)
                model.generate(**kwargs)
    return time.perf_counter() - t0


def best_of(repeat: int, fn) -> float:
    return min(fn() for _ in range(repeat))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/lora.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--quick", action="store_true", help="8 prompts x 8 tokens, 0/1/4/8")
    p.add_argument("--num-prompts", type=int, default=None, help="default 64 (--quick: 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (--quick: 8)")
    p.add_argument("--adapters", default=None, help="comma list of adapter counts")
    p.add_argument(
        "--max-lora-slots", type=int, default=0, help="pool size (0: every adapter fits)"
    )
    p.add_argument("--repeat", type=int, default=1, help="timed runs per measurement (best)")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument(
        "--num-threads", type=int, default=0, help="torch threads of both (0: all cores)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    num_prompts = args.num_prompts or (8 if args.quick else 64)
    new = args.max_new_tokens or (8 if args.quick else 64)
    counts = [
        int(c) for c in (args.adapters or ("0,1,4,8" if args.quick else "0,1,4,16,64")).split(",")
    ]
    max_k = max(counts)

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmengine import Engine, EngineConfig
    from lmengine.api import chat_token_ids
    from lmengine.engine.loader import resolve_model_path

    threads = args.num_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompt_file = Path(__file__).resolve().parent.parent / "examples" / "prompts.txt"
    lines = [ln.strip() for ln in prompt_file.read_text().splitlines() if ln.strip()]
    ids = [
        chat_token_ids(tokenizer, [{"role": "user", "content": lines[i % len(lines)]}])
        for i in range(num_prompts)
    ]
    work = num_prompts * new
    results: dict[str, dict[int, float]] = {"lmengine": {}, "peft": {}}
    base_cfg = dict(
        dtype="float32", device="cpu", num_gpu_blocks=num_prompts * 16 + 64, num_threads=threads
    )

    with tempfile.TemporaryDirectory() as tmp:
        log(f"making {max_k} random adapters")
        paths = make_adapters(path, max_k, Path(tmp)) if max_k else {}

        slots = args.max_lora_slots or max(1, max_k)
        cfg = EngineConfig(**base_cfg, adapters=paths or None, max_lora_slots=slots)
        log(f"lmengine base (no adapters) and with {max_k} adapters, max_lora_slots={slots}")
        base_engine = Engine.from_pretrained(path, EngineConfig(**base_cfg))
        engine = Engine.from_pretrained(path, cfg)
        try:
            run_lmengine(base_engine, ids[:4], [None] * 4, 4)  # warm-up
            run_lmengine(engine, ids[:4], adapter_names(min(4, max_k), 4), 4)
            # NOTE: rounds interleave the base engine and every adapter count, so machine load
            # that drifts during the run reaches all of them alike; best of the rounds
            times: dict[str, list[float]] = {}
            for _ in range(args.repeat):
                dt = run_lmengine(base_engine, ids, [None] * len(ids), new)
                times.setdefault("base", []).append(dt)
                log(f"lmengine base: {work / dt:.1f} tok/s")
                for k in counts:
                    dt = run_lmengine(engine, ids, adapter_names(k, num_prompts), new)
                    times.setdefault(k, []).append(dt)
                    log(f"lmengine {k} adapters: {work / dt:.1f} tok/s")
            base_engine.close()
            results["lmengine base"] = {0: work / min(times.pop("base"))}
            for k, dts in times.items():
                results["lmengine"][k] = work / min(dts)
            stats = engine.stats()
            if not args.skip_peft:
                # NOTE: on the engine's thread (idle now), as lmengine/bench/systems.py does: one
                # OpenMP pool for both systems
                def load_peft():
                    base_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                    if not paths:
                        return base_model.eval()
                    (first, first_path), *rest = paths.items()
                    model = PeftModel.from_pretrained(base_model, first_path, adapter_name=first)
                    for name, p_ in rest:
                        model.load_adapter(p_, adapter_name=name)
                    return model.eval()

                model = engine.call(load_peft, timeout=None)
                if not paths:
                    import contextlib

                    model.disable_adapter = contextlib.nullcontext
                engine.call(lambda: run_peft(model, tokenizer, ids[:4], [None] * 4, 4), None)
                for k in counts:
                    names = adapter_names(k, num_prompts)

                    def timed(names=names):
                        return engine.call(
                            lambda: run_peft(model, tokenizer, ids, names, new), timeout=None
                        )

                    dt = best_of(args.repeat, timed)
                    results["peft"][k] = work / dt
                    log(f"peft {k} adapters: {work / dt:.1f} tok/s")
        finally:
            base_engine.close()
            engine.close()

    base_tps = results["lmengine base"][0]
    lines_out = [
        f"multi-LoRA, {num_prompts} W1 prompts x {new} new tokens, adapters rank 8/16 on "
        f"{'/'.join(TARGETS)}, max_lora_slots={slots} (x rank 16), float32 CPU "
        f"({os.cpu_count()} cores); output tok/s (best of {args.repeat})",
        "",
        "| adapters | lmengine | vs lmengine base | peft | lmengine / peft |",
        "|---:|---:|---:|---:|---:|",
        f"| base model | {base_tps:.1f} | 1.00 | | |",
    ]
    for k in counts:
        lm = results["lmengine"][k]
        pf = results["peft"].get(k)
        pf_s = f"{pf:.1f}" if pf else "-"
        ratio = f"{lm / pf:.2f}" if pf else "-"
        lines_out.append(f"| {k} | {lm:.1f} | {lm / base_tps:.2f} | {pf_s} | {ratio} |")
    lines_out.append("")
    lines_out.append(
        f"adapter loads {stats.get('num_adapter_loads', 0)}, evictions "
        f"{stats.get('num_adapter_evictions', 0)}"
    )
    print("\n".join(lines_out))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "stats": stats}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
