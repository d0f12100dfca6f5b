"""Int8 KV cache against the float32 cache, in one run, at the same KV memory budget.

    python benchmarks/kv_int8.py            # SmolLM2-135M-Instruct, float32 weights, CPU
    python benchmarks/kv_int8.py --quick    # a smoke test with small sizes

For each cache (kv_cache_dtype "auto" = float32 here, and "int8") the device pool gets
`--kv-mib` MiB, so it holds `budget // block_bytes` blocks (int8 blocks count their scales).
Then:
- fit: sequences of prompt + new tokens that fit in the pool at once (blocks / blocks per seq);
- a workload of `--num-requests` random prompts of `--prompt-len` tokens, `--max-new-tokens`
  each with EOS ignored, all submitted at once: the peak batch the scheduler ran, the
  preemptions it needed, and generated tokens per second;
- perplexity on the committed held-out text (lmengine/quant/data/heldout.txt), `--windows`
  windows of 128 tokens, through each cache;
- the compiled CPU decode-attention kernel alone, float32 and int8 cache, interleaved: 32
  sequences of `--kernel-context` keys with the model's head shapes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from lmengine.config import EngineConfig, GenerationConfig
from lmengine.engine.cache_engine import CacheSpec
from lmengine.engine.engine import Engine
from lmengine.engine.loader import resolve_model_path
from lmengine.models.model_info import ModelInfo
from lmengine.quant.eval import heldout_token_ids, perplexity

WINDOW = 128


def run_mode(model: str | None, kv: str, args) -> dict:
    from transformers import AutoConfig

    info = ModelInfo.from_hf(AutoConfig.from_pretrained(resolve_model_path(model)))
    block_size = EngineConfig().block_size
    spec = CacheSpec(
        info.num_layers, info.num_kv_heads, info.head_dim, block_size, torch.float32, kv
    )
    block_bytes = spec.block_bytes
    num_blocks = (args.kv_mib << 20) // block_bytes
    per_seq = -(-(args.prompt_len + args.max_new_tokens) // block_size)
    cfg = EngineConfig(dtype="float32", device="cpu", kv_cache_dtype=kv, num_gpu_blocks=num_blocks)
    engine = Engine.from_pretrained(model, cfg)
    try:
        batches: list[int] = []
        engine.add_observer(lambda report: batches.append(len(report.scheduled)))
        rng = random.Random(0)
        vocab = engine.tokenizer.vocab_size
        prompts = [
            [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
            for _ in range(args.num_requests)
        ]
        gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        reqs = [engine.client.request(p, gen) for p in prompts]
        t0 = time.perf_counter()
        for req in reqs:
            engine.client.submit(req)
        queues = [req.response_queue for req in reqs]
        out_tokens = 0
        for q in queues:
            while (r := q.get()).finish_reason is None:
                pass
            if r.error:
                raise RuntimeError(r.error)
            out_tokens += r.generate_token_len
        seconds = time.perf_counter() - t0
        stats = engine.stats()
        engine.check_integrity()
        ppl = perplexity(engine, heldout_token_ids(engine.tokenizer), WINDOW, args.windows)
    finally:
        engine.close()
    return {
        "block_bytes": block_bytes,
        "blocks": num_blocks,
        "fit": num_blocks // per_seq,
        "peak_batch": max(batches),
        "preemptions": stats["num_preemptions"],
        "seconds": seconds,
        "tok_s": out_tokens / seconds,
        "ppl": ppl,
    }


def kernel_ms(model: str | None, context: int, repeat: int) -> dict[str, float]:
    """Median ms of the compiled decode kernel over a float32 and an int8 cache."""
    from transformers import AutoConfig

    from lmengine.kernels import cpu_ext
    from lmengine.kernels.kv_quant import quantize_kv_ref

    ext = cpu_ext.load()
    if ext is None:
        return {}
    info = ModelInfo.from_hf(AutoConfig.from_pretrained(resolve_model_path(model)))
    seqs, bs = 32, 16
    kv, heads, d = info.num_kv_heads, info.num_heads, info.head_dim
    blocks = seqs * (-(-context // bs))
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(blocks, bs, kv, d, generator=gen) for _ in range(2))
    (kq, ks), (vq, vs) = quantize_kv_ref(kc), quantize_kv_ref(vc)
    q = torch.randn(seqs, heads, d, generator=gen)
    tables = torch.randperm(blocks, generator=gen).view(seqs, -1).int().contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    calls = {
        "float32": lambda: ext.paged_decode_attention(q, kc, vc, tables, lens, d**-0.5),
        "int8": lambda: ext.paged_decode_attention_int8(q, kq, vq, ks, vs, tables, lens, d**-0.5),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeat):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/kv_int8.py", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    p.add_argument("--kv-mib", type=int, default=48, help="KV pool budget, MiB")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--windows", type=int, default=8, help="perplexity windows of 128 tokens")
    p.add_argument("--kernel-context", type=int, default=1024)
    p.add_argument("--kernel-repeat", type=int, default=30)
    p.add_argument("--kernel-only", action="store_true", help="only the decode-kernel timing")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.kv_mib, args.num_requests, args.windows = 12, 12, 2
        args.prompt_len, args.max_new_tokens = 16, 16
        args.kernel_context, args.kernel_repeat = 256, 5
    print(f"# {' '.join(sys.argv)}")
    if not args.kernel_only:
        workload(args)
    ms = kernel_ms(args.model, args.kernel_context, args.kernel_repeat)
    if ms:
        print(
            f"\ncompiled decode kernel, 32 sequences x {args.kernel_context} keys: float32 "
            f"{ms['float32']:.2f} ms, int8 {ms['int8']:.2f} ms "
            f"(int8/float32 {ms['int8'] / ms['float32']:.2f}x)",
            flush=True,
        )
    return 0


def workload(args) -> None:
    res = {kv: run_mode(args.model, kv, args) for kv in ("auto", "int8")}
    print(
        f"KV budget {args.kv_mib} MiB; {args.num_requests} requests of {args.prompt_len} prompt "
        f"+ {args.max_new_tokens} new tokens\n"
    )
    print("| KV cache | bytes/block | blocks | seqs that fit | peak batch | preemptions "
          "| seconds | out tok/s | perplexity |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kv, name in (("auto", "float32"), ("int8", "int8")):
        r = res[kv]
        print(
            f"| {name} | {r['block_bytes']} | {r['blocks']} | {r['fit']} | {r['peak_batch']} | "
            f"{r['preemptions']} | {r['seconds']:.2f} | {r['tok_s']:.1f} | {r['ppl']:.4f} |"
        )
    a, b = res["auto"], res["int8"]
    print(
        f"| int8/float32 | | {b['blocks'] / a['blocks']:.2f}x | {b['fit'] / max(1, a['fit']):.2f}x "
        f"| {b['peak_batch'] / a['peak_batch']:.2f}x | | | {b['tok_s'] / a['tok_s']:.2f}x | "
        f"{100 * (b['ppl'] / a['ppl'] - 1):+.2f} % |",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
