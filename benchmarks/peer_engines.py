"""One engine's W1 / W2 / W3 on given token ids, for benchmarks/peers.py.

It runs in the engine's own Python (a venv with vLLM's CPU build need not have lmengine), so
it imports nothing but the standard library and the engine it drives:

    PYTHON benchmarks/peer_engines.py ENGINE --workloads WL.json --out RESULT.json
        [--model PATH] [--reps 2] [--threads N]

ENGINE is `lmengine`, `lmengine-gguf` (lmengine computing on a GGUF file's blocks) or `vllm`
(its CPU build, float32). WL.json holds {"W1": {"prompts": [[ids...]], "max_new_tokens": N},
"W2": ..., "W3": ...}. Every engine runs as its users run it offline: all of a workload's
prompts handed over in one call, greedy, EOS ignored; building the engine and one warm-up call
are not timed.

- W1: output tokens / the wall time of one call with every prompt.
- W2 (one prompt): time to first token = a call with one new token; decode tok/s = (N - 1) /
  (T(N) - T(1)).
- W3: prompt tokens / the wall time of a call with one new token (every prompt prefilled).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def lmengine_generator(args: argparse.Namespace):
    from lmengine import EngineConfig, GenerationConfig, pipeline

    options = {"quant_policy": "gguf"} if args.engine == "lmengine-gguf" else {}
    if args.threads:
        options["num_threads"] = args.threads
    pipe = pipeline(args.model, engine_config=EngineConfig(**options))

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        cfg = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        return [list(r.token_ids) for r in pipe(prompts, gen_config=cfg)]

    return generate


def vllm_generator(args: argparse.Namespace):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # NOTE: on the CPU backend gpu_memory_utilization is the share of host RAM it reserves
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=2048,
        enable_prefix_caching=False,  # repeated runs must not hit a cache
        max_num_seqs=64,
        seed=0,
        gpu_memory_utilization=0.25,
    )

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outs = llm.generate(batch, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


GENERATORS = {
    "lmengine": lmengine_generator,
    "lmengine-gguf": lmengine_generator,
    "vllm": vllm_generator,
}


def timed(generate, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = generate(prompts, new_tokens)
    seconds = time.perf_counter() - start
    if [len(o) for o in outs] != [new_tokens] * len(prompts):
        raise RuntimeError(f"asked for {new_tokens} tokens each, got {[len(o) for o in outs]}")
    return seconds, outs


def run(args: argparse.Namespace) -> dict:
    workloads = json.loads(open(args.workloads).read())
    start = time.perf_counter()
    generate = GENERATORS[args.engine](args)
    result: dict = {"engine": args.engine, "start_s": time.perf_counter() - start}
    first = next(iter(workloads.values()))
    timed(generate, first["prompts"][:2], 4)  # warm-up
    for name, wl in workloads.items():
        prompts, new = wl["prompts"], wl["max_new_tokens"]
        reps: list[dict] = []
        for _ in range(args.reps):
            if name == "W1":
                seconds, outs = timed(generate, prompts, new)
                reps.append({"out_tok_s": len(prompts) * new / seconds})
            else:
                first_s, _ = timed(generate, prompts, 1)
                rep = {"ttft_s": first_s, "prefill_tok_s": sum(map(len, prompts)) / first_s}
                if name == "W2":
                    seconds, outs = timed(generate, prompts, new)
                    rep["decode_tok_s"] = (new - 1) / (seconds - first_s)
                else:
                    outs = []
                reps.append(rep)
        medians = {key: statistics.median(r[key] for r in reps) for key in reps[0]}
        result[name] = {"reps": reps, **medians, "outputs": outs[:16]}
        print(name, json.dumps(medians), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("engine", choices=sorted(GENERATORS))
    p.add_argument("--workloads", required=True, help="the token ids (JSON, see above)")
    p.add_argument("--out", required=True, help="where the result goes (JSON)")
    p.add_argument("--model", default=None, help="folder or file (lmengine: default model)")
    p.add_argument("--reps", type=int, default=2, help="timed runs per workload (median)")
    p.add_argument("--threads", type=int, default=0, help="compute threads (0: all cores)")
    args = p.parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
