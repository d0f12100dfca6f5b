"""Speculative decoding off and on, against transformers' own, in one run.

    python benchmarks/speculative.py            # SmolLM2-135M-Instruct, float32, CPU
    python benchmarks/speculative.py --quick    # a smoke test with small sizes

Workloads (greedy, chat template, EOS ignored, N new tokens):
- copy: "repeat this paragraph" over the paragraphs of lmengine/quant/data/heldout.txt, the
  repetitive text prompt lookup is made for (the answer copies the prompt);
- chat: the prompts of examples/prompts.txt (little to look up).

Modes: lmengine without speculation, with prompt lookup (`ngram`), and with the model as its
own draft (`self`: every draft is accepted, the draft costs as much as the target, so it
shows the verification machinery's overhead, not a speed-up). Each request runs alone
(`--concurrency 1`, the latency case speculation is for) unless asked otherwise.
transformers baselines, one request at a time: `generate()`, and for `ngram` / `self` its
own prompt lookup (`prompt_lookup_num_tokens`) / assisted generation (`assistant_model`).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

from lmengine.config import EngineConfig, GenerationConfig, SpeculativeConfig
from lmengine.engine.engine import Engine
from lmengine.engine.loader import resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "examples" / "prompts.txt"
HELDOUT = ROOT / "lmengine" / "quant" / "data" / "heldout.txt"


def workload(tokenizer, name: str, num: int) -> list[list[int]]:
    if name == "copy":
        paragraphs = [p.strip() for p in HELDOUT.read_text().split("\n\n") if p.strip()]
        texts = [
            "Repeat the following paragraph word for word.\n\n" + paragraphs[i % len(paragraphs)]
            for i in range(num)
        ]
    else:
        lines = [x.strip() for x in PROMPTS.read_text().splitlines() if x.strip()]
        texts = [lines[i % len(lines)] for i in range(num)]
    from lmengine.api import chat_token_ids

    return [chat_token_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def speculative_config(mode: str, path: str, k: int) -> SpeculativeConfig | None:
    if mode == "off":
        return None
    if mode == "ngram":
        return SpeculativeConfig("ngram", num_speculative_tokens=k)
    return SpeculativeConfig("draft_model", num_speculative_tokens=k, draft_model=path)


def run_lmengine(path: str, mode: str, prompts: list[list[int]], args) -> dict:
    cfg = EngineConfig(
        dtype="float32",
        device="cpu",
        speculative=speculative_config(mode, path, args.k),
        num_threads=args.num_threads,
    )
    engine = Engine.from_pretrained(path, cfg)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    try:
        engine.create_instance().infer(0, prompts[0][:8], gen_config=GenerationConfig(2))  # warm up
        outputs: list[list[int] | None] = [None] * len(prompts)

        def worker(t: int) -> None:
            inst = engine.create_instance()
            for i in range(t, len(prompts), args.concurrency):
                outputs[i] = inst.infer(i + 1, prompts[i], gen_config=gen).token_ids

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(args.concurrency)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        dt = time.perf_counter() - t0
        stats = engine.stats().get("speculative") or {}
        engine.check_integrity()
    finally:
        engine.close()
    return {"seconds": dt, "outputs": outputs, **stats}


def run_transformers(path: str, mode: str, prompts: list[list[int]], args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kwargs: dict = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    kwargs.update(do_sample=False)
    if mode == "ngram":
        kwargs["prompt_lookup_num_tokens"] = args.k
    elif mode == "self":
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        kwargs["num_assistant_tokens"] = args.k
        kwargs["num_assistant_tokens_schedule"] = "constant"
    outputs = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2)  # warm up
        t0 = time.perf_counter()
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                **kwargs,
            )
            outputs.append(out[0, len(ids) :].tolist())
        dt = time.perf_counter() - t0
    return {"seconds": dt, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/speculative.py", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (lmengine)")
    p.add_argument("--workloads", default="copy,chat")
    p.add_argument("--modes", default="off,ngram,self")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument(
        "--num-threads", type=int, default=0, help="torch threads of both (0: all cores)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens = 2, 16
    from transformers import AutoTokenizer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(f"# {' '.join(sys.argv)}  (torch threads: {torch.get_num_threads()})")
    print(
        "| workload | mode | lmengine tok/s | speed-up vs off | acceptance | accepted/step "
        "| same tokens as off | transformers tok/s | lmengine / transformers |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    for name in args.workloads.split(","):
        prompts = workload(tokenizer, name, args.num_prompts)
        total = args.num_prompts * args.max_new_tokens
        base = None
        for mode in args.modes.split(","):
            r = run_lmengine(path, mode, prompts, args)
            if mode == "off":
                base = r
            hf = None if args.no_hf else run_transformers(path, mode, prompts, args)
            ours = total / r["seconds"]
            cells = [
                name,
                mode,
                f"{ours:.1f}",
                f"{base['seconds'] / r['seconds']:.2f}x" if base else "",
                f"{r['acceptance_rate']:.0%}" if "acceptance_rate" in r else "",
                f"{r['mean_accepted_per_step']:.2f}" if "acceptance_rate" in r else "",
                ("yes" if r["outputs"] == base["outputs"] else "NO") if base else "",
                f"{total / hf['seconds']:.1f}" if hf else "",
                f"{hf['seconds'] / r['seconds']:.2f}x" if hf else "",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
