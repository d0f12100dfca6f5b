"""W8A8 under tensor parallelism: what per-shard activation scales would cost in accuracy.

    python benchmarks/tp_w8a8_scales.py --quick   # SmolLM2-135M, calibration 16 x 128
    python benchmarks/tp_w8a8_scales.py           # calibration 64 x 256, more prompts

A row-parallel layer (o_proj, down_proj) gets its input split by columns; each rank quantizes
its shard per token and runs the int8 GEMM of its weight columns. Three ways to do it:
- "exact" (lmengine): per-token absmax over all ranks (one all-reduce of num_tokens floats),
  the int32 accumulators summed (all-reduce), then the dequantizing epilogue: what tp=1 does.
- "float-sum": the same int8 values, but each rank dequantizes and the float partials are
  summed (the all-reduce of a float rowwise layer): differs from tp=1 in the last bits only.
- "local": each shard quantized with its own absmax, float partials summed (the cheapest).
SmolLM2-135M has 9 heads, so only tp=3 splits it, which needs 3 cores; this script therefore
simulates the row-parallel layers of tp=N in one process on the real SmoothQuant checkpoint
(input and weight cut into N column shards, partials summed in rank order; for tp=2 the
o_proj cut falls inside a head, which changes nothing for the quantization). Measured
against tp=1 w8a8: logits on the held-out text (max and mean |diff|, next-token argmax
agreement, perplexity) and greedy generation of chat prompts (tokens equal to tp=1).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.api import Pipeline
from lmengine.distributed.w8a8 import int32_accumulate, quantize_with_amax
from lmengine.engine.loader import resolve_model_path
from lmengine.kernels.w8a8 import _MIN_AMAX, QMAX, int8_gemm
from lmengine.models.context import step_context
from lmengine.models.w8a8 import W8A8Linear
from lmengine.quant.eval import heldout_token_ids
from lmengine.quant.w8a8 import quantize_checkpoint

PROMPT_FILE = Path(__file__).resolve().parent.parent / "examples" / "prompts.txt"


def _log(msg: str) -> None:
    print(f"[tp w8a8 scales] {msg}", file=sys.stderr, flush=True)


def simulate_row_parallel(engine: Engine, tp: int, mode: str | None) -> None:
    """Make o_proj / down_proj of the engine's model compute as tp ranks would (None: undo)."""
    for name, module in engine.model_agent.model.named_modules():
        if not isinstance(module, W8A8Linear) or not name.endswith(("o_proj", "down_proj")):
            continue
        if mode is None:
            module.__dict__.pop("forward", None)
            continue

        def forward(x, module=module):
            shards = x.split(x.shape[-1] // tp, dim=-1)
            weights = module.weight.split(x.shape[-1] // tp, dim=-1)
            if mode != "local":
                amax = x.abs().amax(-1, keepdim=True).float().clamp(min=_MIN_AMAX)
            out = acc = None
            for rank, (xs, ws) in enumerate(zip(shards, weights)):
                if mode == "local":
                    amax = xs.abs().amax(-1, keepdim=True).float().clamp(min=_MIN_AMAX)
                q = quantize_with_amax(xs, amax)
                if mode == "exact":
                    part = int32_accumulate(q, ws)
                    acc = part if acc is None else acc + part
                    continue
                bias = module.bias if rank == 0 else None
                part = int8_gemm(
                    q, amax / QMAX, ws.contiguous(), module.weight_scale, bias, x.dtype
                )
                out = part if out is None else out + part
            if mode == "exact":
                out = torch.mul(acc, amax / QMAX).mul_(module.weight_scale)
                if module.bias is not None:
                    out.add_(module.bias)
            return out

        module.forward = forward


def heldout_logits(engine: Engine, ids: list[int], window: int, windows: int) -> torch.Tensor:
    """[windows * window, vocab] float32 logits of the held-out windows, one packed prefill."""
    chunks = [ids[i * window : (i + 1) * window] for i in range(windows)]

    def run() -> torch.Tensor:
        agent = engine.model_agent
        per = math.ceil(window / agent.block_size)
        items = [
            SimpleNamespace(
                token_ids=c,
                start_pos=0,
                num_new_tokens=window,
                needs_sample=True,
                block_table=list(range(i * per, (i + 1) * per)),
            )
            for i, c in enumerate(chunks)
        ]
        input_ids, ctx = agent.prepare(SimpleNamespace(scheduled=items, adapter_plan=None))
        ctx.logits_indices = torch.arange(input_ids.shape[0])
        with torch.inference_mode(), step_context(ctx):
            return agent.model(input_ids).float()

    return engine.call(run, timeout=None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="benchmarks/tp_w8a8_scales.py", allow_abbrev=False)
    p.add_argument("--model", default=None, help="float checkpoint (default: SmolLM2-135M)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tp", type=int, nargs="+", default=[3], help="simulated ranks")
    p.add_argument("--out-dir", default=None, help="the w8a8 checkpoint (default: temp)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    calib = (16, 128) if args.quick else (64, 256)
    num_prompts, new_tokens, windows = (16, 32, 4) if args.quick else (64, 64, 8)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="tp_w8a8_"))
    if not (out / "config.json").is_file():
        _log(f"quantizing to {out} (calibration {calib[0]} x {calib[1]})")
        quantize_checkpoint(
            resolve_model_path(args.model), out, calib_samples=calib[0], calib_seqlen=calib[1]
        )
    engine = Engine.from_pretrained(str(out), EngineConfig(device="cpu", num_gpu_blocks=160))
    pipe = Pipeline(engine)
    prompts = [ln.strip() for ln in PROMPT_FILE.read_text().splitlines() if ln.strip()]
    prompts = (prompts * math.ceil(num_prompts / len(prompts)))[:num_prompts]
    chats = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in prompts
    ]
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    ids = heldout_token_ids(engine.tokenizer)
    targets = torch.tensor([ids[i * 128 + 1 : (i + 1) * 128] for i in range(windows)])
    results = {}
    try:
        ref_logits = heldout_logits(engine, ids, 128, windows)
        ref_tokens = [o.token_ids for o in pipe(chats, gen_config=gen)]
        for tp in args.tp:
            for mode in ("exact", "float-sum", "local"):
                simulate_row_parallel(engine, tp, mode)
                logits = heldout_logits(engine, ids, 128, windows)
                tokens = [o.token_ids for o in pipe(chats, gen_config=gen)]
                simulate_row_parallel(engine, tp, None)
                diff = (logits - ref_logits).abs()
                lg = logits.view(windows, 128, -1)[:, :-1]
                nll = torch.nn.functional.cross_entropy(
                    lg.reshape(-1, lg.shape[-1]), targets.reshape(-1)
                )
                ref_lg = ref_logits.view(windows, 128, -1)[:, :-1]
                ref_nll = torch.nn.functional.cross_entropy(
                    ref_lg.reshape(-1, ref_lg.shape[-1]), targets.reshape(-1)
                )
                row = dict(
                    max_abs_logit_diff=diff.max().item(),
                    mean_abs_logit_diff=diff.mean().item(),
                    argmax_agreement=(logits.argmax(-1) == ref_logits.argmax(-1))
                    .float()
                    .mean()
                    .item(),
                    ppl=math.exp(nll.item()),
                    ppl_tp1=math.exp(ref_nll.item()),
                    prompts_equal=sum(a == b for a, b in zip(tokens, ref_tokens)),
                    tokens_equal=sum(
                        x == y for a, b in zip(tokens, ref_tokens) for x, y in zip(a, b)
                    ),
                    num_prompts=len(tokens),
                    num_tokens=sum(len(a) for a in ref_tokens),
                )
                results[f"tp{tp}_{mode}"] = row
                _log(f"tp={tp} {mode}: {json.dumps(row)}")
    finally:
        engine.close()
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
