"""The `lmengine` command: generate, chat, bench, serve, quantize.

Engine and generation flags are generated from the `EngineConfig` and `GenerationConfig`
dataclasses (help text from their field comments), so the flags and the configs never drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import time
from pathlib import Path

from lmengine.config import EngineConfig, GenerationConfig

_GEN_DEFAULTS = {"max_new_tokens": 256}  # the CLI's own default, shorter than the API's


def _field_help(cls) -> dict[str, str]:
    """`name: type = default  # help` comments of a dataclass, by field name."""
    helps = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):[^#]*=[^#]*#\s*(.+)$", line)
        if m:
            helps[m.group(1)] = m.group(2).strip()
    return helps


def _parse_mapping(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {item!r}")
        out[name] = value
    return out


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, title: str, defaults=None) -> None:
    """One flag per dataclass field, `--field-name`, typed from the annotation."""
    group = parser.add_argument_group(title)
    helps = _field_help(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        ann = str(f.type)
        default = defaults.get(f.name, f.default)
        if default is dataclasses.MISSING:  # a default_factory field
            default = f.default_factory()
        text = helps.get(f.name, "")
        text = f"{text} (default: {default})" if text else f"default: {default}"
        kwargs = dict(dest=f"{cls.__name__}.{f.name}", default=None, help=text)
        if ann.startswith("bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif ann.startswith("list[int]"):
            group.add_argument(flag, nargs="+", type=int, metavar="ID", **kwargs)
        elif ann.startswith("list[str]"):
            group.add_argument(flag, nargs="+", metavar="TEXT", **kwargs)
        elif ann.startswith("dict"):
            group.add_argument(flag, nargs="+", metavar="NAME=PATH", **kwargs)
        elif ann.startswith("int"):
            group.add_argument(flag, type=int, **kwargs)
        elif ann.startswith("float"):
            group.add_argument(flag, type=float, **kwargs)
        else:
            group.add_argument(flag, type=str, **kwargs)


def build_dataclass(cls, args: argparse.Namespace, defaults=None):
    """The dataclass from parsed flags; unset flags keep the dataclass (or given) defaults."""
    values = dict(defaults or {})
    prefix = cls.__name__ + "."
    for key, value in vars(args).items():
        if key.startswith(prefix) and value is not None:
            name = key[len(prefix) :]
            if isinstance(value, list) and str(
                next(f.type for f in dataclasses.fields(cls) if f.name == name)
            ).startswith("dict"):
                value = _parse_mapping(value)
            values[name] = value
    return cls(**values)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    add_dataclass_flags(p, EngineConfig, "engine options")


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompt_file:
        lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise SystemExit("lmengine generate: give prompts as arguments or --prompt-file FILE")
    return prompts


def cmd_generate(args) -> int:
    from lmengine.api import pipeline

    prompts = _read_prompts(args)
    engine_config = build_dataclass(EngineConfig, args)
    gen_config = build_dataclass(GenerationConfig, args, _GEN_DEFAULTS)
    t0 = time.perf_counter()
    with pipeline(args.model, engine_config, apply_chat_template=not args.no_chat_template) as pipe:
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
    with pipeline(args.model, engine_config) as pipe:
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

    if args.calib_file and not Path(args.calib_file).is_file():
        raise ValueError(f"--calib-file {args.calib_file}: no such file")
    t0 = time.perf_counter()
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
    quant = sub.add_parser("quantize", help="quantize a checkpoint (w8a8 SmoothQuant)")
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
        prog="lmengine", description="lmengine: LLM inference on PyTorch and transformers"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline batch generation over prompts")
    gen.add_argument("prompts", nargs="*", help="prompts (each one user turn of the chat)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument("--jsonl", help="also write one JSON object per prompt to this file")
    gen.add_argument("--quiet", action="store_true", help="no progress bar, no answers printed")
    gen.add_argument("--adapter-name", help="LoRA adapter (from --adapters) for every prompt")
    gen.add_argument(
        "--no-chat-template", action="store_true", help="send prompts raw, without the template"
    )
    _add_model_flags(gen)
    add_dataclass_flags(gen, GenerationConfig, "generation options", _GEN_DEFAULTS)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat, streaming")
    chat.add_argument("--system", help="a system prompt")
    _add_model_flags(chat)
    add_dataclass_flags(chat, GenerationConfig, "generation options", _GEN_DEFAULTS)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser(
        "bench", help="throughput against transformers, in one run (benchmarks/throughput.py)"
    )
    from lmengine.bench import add_bench_flags

    add_bench_flags(bench)
    bench.set_defaults(func=cmd_bench)
    _add_quantize_parser(sub)

    from lmengine.serve.server import add_serve_flags, cmd_serve

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (lmengine/serve)")
    add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad flag values: one clear line, not a traceback
        print(f"lmengine {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
