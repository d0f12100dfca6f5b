"""One engine's W1 / W2 / W3 on given token ids, for benchmarks/peers.py.

It runs in the engine's own Python (a venv with vLLM's CPU build need not have lmengine), so
it imports nothing but the standard library and the engine it drives:

    PYTHON benchmarks/peer_engines.py ENGINE --workloads WL.json --out RESULT.json
        [--model PATH] [--reps 2] [--threads N] [--dtype float32|bfloat16] [--batch N]

ENGINE is `lmengine`, `lmengine-gguf` (lmengine computing on a GGUF file's blocks, float32),
`vllm` (its CPU build), `transformers` (its own `generate`, eager attention, the prompts
left-padded into batches of --batch, all in one by default; lmengine, vLLM and transformers
compute in --dtype, float32 unless told) or `llamacpp` (llama.cpp through llama-cpp-python, on
a GGUF file, batched). WL.json holds
{"W1": {"prompts": [[ids...]], "max_new_tokens": N}, "W2": ..., "W3": ...}. Every engine runs
as its users run it offline: all of a workload's prompts handed over in one call, greedy, EOS
ignored; building the engine and one warm-up call are not timed.

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

    # the default model is a GGUF file: "float" for its float32 expansion
    options = {"quant_policy": "gguf" if args.engine == "lmengine-gguf" else "float"}
    if args.engine == "lmengine":
        options["dtype"] = args.dtype
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
        dtype=args.dtype,
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


def transformers_generator(args: argparse.Namespace):
    """transformers' `generate` as its users batch it: each batch of --batch prompts (0: all)
    padded on the left and masked, greedy, eager attention, its default cache and experts
    implementation, in --dtype. EOS is ignored by generating with no EOS token."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="eager"
    ).eval()
    config = model.config
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    pad = next((t for t in (config.pad_token_id, eos) if t is not None), 0)  # masked anyway
    # NOTE: generate fills what it is not given from model.generation_config, which holds the
    # folder's EOS ids and sampling values: replaced by one with neither
    model.generation_config = GenerationConfig(pad_token_id=pad)

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        outs: list[list[int]] = []
        size = args.batch or len(prompts)
        for i in range(0, len(prompts), size):
            batch = prompts[i : i + size]
            width = max(map(len, batch))
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():  # [batch, width + new_tokens]
                ids = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    do_sample=False,
                )
            outs += ids[:, width:].tolist()
        return outs

    generate.how = (  # type: ignore[attr-defined]
        f"{args.dtype}, attention {config._attn_implementation}, experts "
        f"{getattr(config, '_experts_implementation', None)}, batch {args.batch or 'all'}"
    )
    return generate


def llamacpp_generator(args: argparse.Namespace):
    """llama.cpp batched as its own batched examples run it, through llama-cpp-python's
    low-level API: one sequence id (and KV stream) per prompt; the prompts packed into decode
    calls of up to 2,048 tokens, then one call per step with one token of every sequence;
    greedy = the argmax of each sequence's logits."""
    import os

    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    # NOTE: llama.cpp 0.3.36 repacks Q4_1 weights for AMX where the CPU has it, and its first
    # decode then crashes (Intel Xeon, family 6, model 167); its plain CPU kernels run instead
    model_params.use_extra_bufts = os.environ.get("LMENGINE_PEER_LLAMACPP_AMX") == "1"
    model = lc.llama_model_load_from_file(args.model.encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {args.model}")
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    threads = args.threads or os.cpu_count() or 1
    max_batch = 2048
    batch = lc.llama_batch_init(max_batch, 0, 1)
    contexts: dict[tuple[int, int], object] = {}

    def context(num_seqs: int, cells: int):
        """A context with `cells` KV cells per sequence, kept while the shape repeats."""
        if (num_seqs, cells) not in contexts:
            for old in contexts.values():
                lc.llama_free(old)
            contexts.clear()
            params = lc.llama_context_default_params()
            params.n_ctx, params.n_seq_max = num_seqs * cells, num_seqs
            params.n_batch, params.n_ubatch, params.kv_unified = max_batch, 512, False
            params.n_threads = params.n_threads_batch = threads
            contexts[(num_seqs, cells)] = lc.llama_init_from_model(model, params)
        return contexts[(num_seqs, cells)]

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        cells = -(-(max(map(len, prompts)) + new_tokens) // 256) * 256
        ctx = context(len(prompts), cells)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        outs: list[list[int]] = [[] for _ in prompts]
        sampled: dict[int, int] = {}  # sequence -> its row in the batch whose logits it takes

        def put(token: int, pos: int, seq: int, logits: bool) -> None:
            i = batch.n_tokens
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
            batch.n_tokens = i + 1

        def decode() -> None:
            if batch.n_tokens and lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for seq, row in sampled.items():
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(vocab,))
                outs[seq].append(int(logits.argmax()))
            batch.n_tokens = 0
            sampled.clear()

        for seq, prompt in enumerate(prompts):
            if batch.n_tokens + len(prompt) > max_batch:
                decode()
            for pos, token in enumerate(prompt):
                put(token, pos, seq, pos == len(prompt) - 1)
            sampled[seq] = batch.n_tokens - 1
        decode()
        for step in range(1, new_tokens):
            for seq, prompt in enumerate(prompts):
                put(outs[seq][-1], len(prompt) + step - 1, seq, True)
                sampled[seq] = batch.n_tokens - 1
            decode()
        return outs

    return generate


GENERATORS = {
    "lmengine": lmengine_generator,
    "lmengine-gguf": lmengine_generator,
    "vllm": vllm_generator,
    "transformers": transformers_generator,
    "llamacpp": llamacpp_generator,
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
    if hasattr(generate, "how"):  # how the engine was set up, where it says
        result["how"] = generate.how
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
    p.add_argument(
        "--dtype", default="float32", help="lmengine, vllm and transformers: float32 or bfloat16"
    )
    p.add_argument(
        "--batch", type=int, default=0, help="transformers: prompts per generate call (0: all)"
    )
    args = p.parse_args(argv)
    if args.batch < 0:
        p.error("--batch must be >= 0")
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
