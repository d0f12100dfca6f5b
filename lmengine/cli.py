"""The `lmengine` command: generate, chat, bench, serve, quantize.

Engine and generation flags are generated from the `EngineConfig` and `GenerationConfig`
dataclasses (`lmengine/flags.py`). Flags are never abbreviated, and a flag naming a missing
or unreadable file is one line on stderr and exit status 2, checked before any model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lmengine.config import EngineConfig, GenerationConfig
from lmengine.flags import (
    FlagError,
    add_dataclass_flags,
    add_model_flags,
    build_dataclass,
    check_path_flags,
    model_load_errors,
    one_line,
)

__all__ = ["add_dataclass_flags", "build_dataclass", "build_parser", "main"]

_GEN_DEFAULTS = {"max_new_tokens": 256}  # the CLI's own default, shorter than the API's


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompt_file:
        try:
            lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise FlagError(f"--prompt-file: not UTF-8 text: {args.prompt_file}") from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise FlagError("give prompts as arguments or --prompt-file FILE")
    return prompts


def cmd_generate(args) -> int:
    from lmengine.api import pipeline

    prompts = _read_prompts(args)
    engine_config = build_dataclass(EngineConfig, args)
    gen_config = build_dataclass(GenerationConfig, args, _GEN_DEFAULTS)
    t0 = time.perf_counter()
    with model_load_errors(args.model, engine_config):
        pipe = pipeline(args.model, engine_config, apply_chat_template=not args.no_chat_template)
    with pipe:
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        outs = pipe(
            prompts,
            gen_config=gen_config,
            adapter_name=args.adapter_name,
            use_tqdm=not args.quiet,
        )
        gen_s = time.perf_counter() - t1
    sink = open(args.jsonl, "w", encoding="utf-8") if args.jsonl else None
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if sink is not None:
            record = {
                "index": i,
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "input_token_len": out.input_token_len,
                "generate_token_len": out.generate_token_len,
                "error": out.error,
            }
            if out.beam_token_ids is not None:  # beam search: the num_return_sequences best
                record["beams"] = [
                    {"text": text, "token_ids": ids, "score": score}
                    for text, ids, score in zip(
                        out.beam_texts or [None] * len(out.beam_token_ids),
                        out.beam_token_ids,
                        out.beam_scores,
                    )
                ]
            if out.logprobs is not None:
                record["logprobs"] = [{str(k): v for k, v in d.items()} for d in out.logprobs]
            if out.prompt_logprobs is not None:
                record["prompt_logprobs"] = [
                    None if d is None else {str(k): v for k, v in d.items()}
                    for d in out.prompt_logprobs
                ]
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        if not args.quiet:
            body = out.text if out.finish_reason != "error" else f"[error] {out.error}"
            print(f"\n### [{i}] {prompt}\n{body}")
    if sink is not None:
        sink.close()
    num_out = sum(o.generate_token_len for o in outs)
    num_in = sum(o.input_token_len for o in outs)
    print(
        f"\n{len(outs)} prompts, {num_in} prompt tokens, {num_out} generated tokens in "
        f"{gen_s:.1f} s: {num_out / gen_s:.1f} output tokens/s "
        f"({(num_in + num_out) / gen_s:.1f} total tokens/s; model load {load_s:.1f} s)",
        file=sys.stderr,
    )
    return 1 if any(o.finish_reason == "error" for o in outs) else 0


def cmd_chat(args) -> int:
    from lmengine.api import pipeline

    engine_config = build_dataclass(EngineConfig, args)
    gen_config = build_dataclass(GenerationConfig, args, _GEN_DEFAULTS)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    with model_load_errors(args.model, engine_config):
        pipe = pipeline(args.model, engine_config)
    with pipe:
        if interactive:
            print("lmengine chat: type a message; '/reset' clears the history, '/exit' quits.")
        while True:
            if interactive:
                print("\nuser> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            message = line.strip()
            if not message:
                continue
            if message in ("/exit", "/quit", "exit", "quit"):
                break
            if message == "/reset":
                history = history[:1] if args.system else []
                print("(history cleared)")
                continue
            history.append({"role": "user", "content": message})
            print("assistant> ", end="", flush=True)
            reply, reason = "", None
            for delta in pipe.stream_infer([history], gen_config=gen_config):
                print(delta.text, end="", flush=True)
                reply += delta.text
                reason = delta.finish_reason
                if delta.error:
                    print(f"[error] {delta.error}", end="")
            print()
            if reason == "error":
                history.pop()
            else:
                history.append({"role": "assistant", "content": reply})
    return 0


def cmd_bench(args) -> int:
    from lmengine.bench import run_benchmarks

    return run_benchmarks(args)


def cmd_quantize(args) -> int:
    from lmengine.quant.w8a8 import quantize_checkpoint

    t0 = time.perf_counter()
    # NOTE: not under model_load_errors: an OSError may come from writing --out as well
    out = quantize_checkpoint(
        args.model,
        args.out,
        calib_samples=args.calib_samples,
        calib_seqlen=args.calib_seqlen,
        alpha=None if args.no_smooth else args.alpha,
        calib_file=args.calib_file,
        show_progress=not args.quiet,
        fold_rows=args.fold_rows,
        int8_lm_head=not args.float_lm_head,
    )
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _add_quantize_parser(sub) -> None:
    quant = sub.add_parser(
        "quantize", help="quantize a checkpoint (w8a8 SmoothQuant)", allow_abbrev=False
    )
    quant.add_argument("method", choices=["w8a8"], help="quantization method")
    quant.add_argument(
        "model", nargs="?", default=None, help="checkpoint folder, hub id or .gguf (default model)"
    )
    quant.add_argument("--out", required=True, help="output folder of the quantized checkpoint")
    quant.add_argument("--calib-samples", type=int, default=64, help="calibration sequences")
    quant.add_argument("--calib-seqlen", type=int, default=256, help="tokens per sequence")
    quant.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    quant.add_argument(
        "--calib-file", help="calibration text file (default: Python stdlib docstrings)"
    )
    quant.add_argument(
        "--no-smooth", action="store_true", help="no calibration, no smoothing (plain W8A8)"
    )
    quant.add_argument(
        "--fold-rows",
        action="store_true",
        help="also smooth o_proj/down_proj inputs into the v/up rows (worse on SmolLM2)",
    )
    quant.add_argument(
        "--float-lm-head",
        action="store_true",
        help="keep the LM head in float (default: int8 per vocabulary row, as the linears)",
    )
    quant.add_argument("--quiet", action="store_true", help="no progress bar")
    quant.set_defaults(func=cmd_quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmengine",
        description="lmengine: LLM inference on PyTorch and transformers",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate", help="offline batch generation over prompts", allow_abbrev=False
    )
    gen.add_argument("prompts", nargs="*", help="prompts (each one user turn of the chat)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--jsonl", help="also write one JSON object per prompt to this file")
    gen.add_argument("--quiet", action="store_true", help="no progress bar, no answers printed")
    gen.add_argument("--adapter-name", help="LoRA adapter (from --adapters) for every prompt")
    gen.add_argument(
        "--no-chat-template", action="store_true", help="send prompts raw, without the template"
    )
    add_model_flags(gen)
    add_dataclass_flags(gen, GenerationConfig, "generation options", _GEN_DEFAULTS)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat, streaming", allow_abbrev=False)
    chat.add_argument("--system", help="a system prompt")
    add_model_flags(chat)
    add_dataclass_flags(chat, GenerationConfig, "generation options", _GEN_DEFAULTS)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser(
        "bench",
        help="throughput against transformers, in one run (benchmarks/throughput.py)",
        allow_abbrev=False,
    )
    from lmengine.bench import add_bench_flags

    add_bench_flags(bench)
    bench.set_defaults(func=cmd_bench)
    _add_quantize_parser(sub)

    from lmengine.serve.server import add_serve_flags, cmd_serve

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (lmengine/serve)", allow_abbrev=False
    )
    add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def main(argv: list[str] | None = None) -> int:
    """Run one `lmengine` command; bad flags are one line on stderr and exit status 2. Under
    torchrun, ranks other than 0 become the workers of rank 0's engine instead."""
    from lmengine.distributed.launch import check_world_size, run_torchrun_worker, torchrun_rank

    rank = torchrun_rank()
    if rank not in (None, 0):
        return run_torchrun_worker(rank)
    parser = build_parser()
    args = parser.parse_args(argv)
    command = _command_parser(parser, args.command)
    try:
        check_path_flags(command, args)  # NOTE: before anything loads: fail fast
        if rank == 0:
            check_world_size(getattr(args, "EngineConfig.tp", None) or 1)
        return args.func(args)
    except (ValueError, OSError) as e:  # bad flag values and paths: one line, no traceback
        print(f"{command.prog}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
