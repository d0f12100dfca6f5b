"""`lmengine bench` (and `benchmarks/throughput.py`): lmengine against transformers, one process.

Same model, same prompts, float32 on the CPU, every system timed in the same run:

- W1 offline batch: the prompts of examples/prompts.txt as chat prompts, N new tokens each with
  EOS ignored. lmengine (Pipeline over one Engine), transformers static batching (left-padded
  `generate`) and transformers continuous batching (`generate_batch`). Output tokens/s.
- W2 single stream: one ~100-token chat prompt, 256 new tokens. Time to first token and decode
  tokens/s.
- W3 prefill: 8 chat prompts of ~1000 tokens, 16 new tokens. Prompt tokens/s until every
  request has its first token (transformers: a batch `generate` of one token).

Every measurement has one untimed short warm-up per system, then `--repeat` timed runs, those
of lmengine and transformers static alternating on each workload (so load that drifts on a
shared machine reaches both alike); the tables show the best and the median run, and ratios
of the best runs. Progress goes to stderr;
stdout holds the report (a plain table and the same as markdown).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("w1", "w2", "w3")
# examples/prompts.txt of the repository links here: the package carries its own copy
DEFAULT_PROMPT_FILE = Path(__file__).resolve().parent / "data" / "prompts.txt"
LM, HF_STATIC, HF_CB = "lmengine", "transformers static", "transformers CB"

# workload sizes: (full default, --quick default)
_SIZES = {
    "num_prompts": (64, 8),
    "max_new_tokens": (128, 16),
    "w2_prompt_tokens": (100, 100),
    "w2_new_tokens": (256, 32),
    "w3_num_prompts": (8, 2),
    "w3_prompt_tokens": (1000, 256),
    "w3_new_tokens": (16, 4),
}


class BenchError(RuntimeError):
    """A system produced something other than the requested work (errors, wrong lengths)."""


# ---- flags ------------------------------------------------------------------------------------
def _workload_list(text: str) -> list[str]:
    names = [w.strip().lower() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"workloads must be a comma list of {WORKLOADS}")
    return [w for w in WORKLOADS if w in names]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's flags to `parser` (shared by `lmengine bench` and the script)."""
    p = parser
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--workloads",
        type=_workload_list,
        default=list(WORKLOADS),
        help="comma list of w1 (offline batch), w2 (single stream), w3 (prefill); default all",
    )
    p.add_argument(
        "--prompt-file", default=str(DEFAULT_PROMPT_FILE), help="one prompt per line (W1; W2/W3)"
    )
    p.add_argument("--repeat", type=_positive_int, default=1, help="timed runs per measurement")
    p.add_argument(
        "--skip-hf-batch", action="store_true", help="skip transformers generate_batch (slow)"
    )
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON to PATH")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes for a smoke test (defaults become: "
        + ", ".join(f"{k}={v[1]}" for k, v in _SIZES.items())
        + "); explicit size flags still win",
    )
    sizes = p.add_argument_group("workload sizes")
    helps = {
        "num_prompts": "W1 prompts (cycling through the prompt file)",
        "max_new_tokens": "W1 new tokens per prompt",
        "w2_prompt_tokens": "W2 prompt length in tokens (at least)",
        "w2_new_tokens": "W2 new tokens",
        "w3_num_prompts": "W3 number of long prompts",
        "w3_prompt_tokens": "W3 tokens per prompt (at least)",
        "w3_new_tokens": "W3 new tokens per prompt",
    }
    for name, (full, _) in _SIZES.items():
        sizes.add_argument(
            "--" + name.replace("_", "-"),
            type=_positive_int,
            default=None,
            help=f"{helps[name]} (default: {full})",
        )
    from lmengine.config import EngineConfig

    d = EngineConfig()
    eng = p.add_argument_group("lmengine engine knobs (EngineConfig)")
    eng.add_argument(
        "--block-size",
        type=_positive_int,
        default=None,
        help=f"tokens per KV block (default: {d.block_size})",
    )
    eng.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=None,
        help=f"sequences per step; also transformers CB max_requests_per_batch "
        f"(default: {d.max_batch_size})",
    )
    eng.add_argument(
        "--max-prefill-token-num",
        type=_positive_int,
        default=None,
        help=f"prompt tokens per step; also transformers CB max_batch_tokens "
        f"(default: {d.max_prefill_token_num})",
    )
    eng.add_argument(
        "--num-gpu-blocks",
        type=_positive_int,
        default=None,
        help="KV blocks (default: enough for the largest selected workload)",
    )


# ---- results ----------------------------------------------------------------------------------
@dataclass
class Row:
    """One measured number of one system on one workload."""

    workload: str
    system: str
    metric: str
    runs: list[float] = field(default_factory=list)
    higher_is_better: bool = True
    error: str | None = None
    note: str = ""

    @property
    def best(self) -> float | None:
        if not self.runs:
            return None
        return max(self.runs) if self.higher_is_better else min(self.runs)

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None

    def speedup_over(self, other: Row | None) -> float | None:
        """How much better this row is than `other` (>1: better), on the best runs."""
        if other is None or self.best is None or other.best is None:
            return None
        if not self.best or not other.best:
            return None
        return self.best / other.best if self.higher_is_better else other.best / self.best

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(best=self.best, median=self.median)
        return d


@dataclass
class Sizes:
    """Resolved workload sizes."""

    num_prompts: int
    max_new_tokens: int
    w2_prompt_tokens: int
    w2_new_tokens: int
    w3_num_prompts: int
    w3_prompt_tokens: int
    w3_new_tokens: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Sizes:
        col = 1 if getattr(args, "quick", False) else 0
        values = {}
        for name, defaults in _SIZES.items():
            given = getattr(args, name, None)
            values[name] = given if given is not None else defaults[col]
        if values["w2_new_tokens"] < 2:
            raise ValueError("--w2-new-tokens must be >= 2 to measure decode")
        return cls(**values)


# ---- small helpers ----------------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_line() -> str:
    argv = list(sys.argv)
    prog = argv[0] if argv else "lmengine"
    if prog.endswith(".py"):
        head = ["python", os.path.relpath(prog) if os.path.isabs(prog) else prog]
    else:
        head = [Path(prog).name]
    return " ".join(shlex.quote(a) for a in head + argv[1:])


def _machine_info() -> dict[str, Any]:
    import torch
    import transformers

    import lmengine

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lmengine": lmengine.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load] if load else None,
    }


def _read_lines(path: str) -> list[str]:
    lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        raise ValueError(f"no prompts in {path}")
    return lines


# ---- the benchmark ----------------------------------------------------------------------------
class Bench:
    """Holds the loaded systems and the prompts; one method per (workload, system)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.sizes = Sizes.from_args(args)
        self.repeat: int = args.repeat
        self.lines = _read_lines(args.prompt_file)
        self.rows: list[Row] = []
        self.workload_desc: dict[str, str] = {}  # "W1" -> what it ran
        self.setup: dict[str, Any] = {}
        self.torch = torch
        torch.set_num_threads(os.cpu_count() or 1)

    # ---- loading ------------------------------------------------------------------------------
    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lmengine.engine.loader import resolve_model_path

        self.path = resolve_model_path(self.args.model)
        _log(f"model: {self.path}")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._build_prompts()

        t0 = time.perf_counter()
        self.engine = self._load_engine()
        self.setup["lmengine_load_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        self.hf = self._on_engine_thread(
            lambda: (
                AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
                .eval()
                .requires_grad_(False)
            )
        )
        self.setup["transformers_load_s"] = round(time.perf_counter() - t0, 2)
        self.setup["transformers_attn_implementation"] = self.hf.config._attn_implementation
        torch.set_num_threads(os.cpu_count() or 1)

    def _chat_ids(self, text: str) -> list[int]:
        from lmengine.api import chat_token_ids

        if getattr(self.tokenizer, "chat_template", None) is None:  # a base model: raw text
            return list(self.tokenizer(text)["input_ids"])
        return chat_token_ids(self.tokenizer, [{"role": "user", "content": text}])

    def _long_prompt(self, start: int, min_tokens: int) -> list[int]:
        """Chat ids of one user message made of prompt lines from `start` on, >= min_tokens."""
        parts: list[str] = []
        i = start
        while True:
            # grow by whole lines; re-tokenize only every few lines to stay cheap
            for _ in range(8):
                parts.append(self.lines[i % len(self.lines)])
                i += 1
            ids = self._chat_ids(" ".join(parts))
            if len(ids) >= min_tokens:
                while len(parts) > 1:  # trim back to the shortest that still reaches the size
                    shorter = self._chat_ids(" ".join(parts[:-1]))
                    if len(shorter) < min_tokens:
                        break
                    parts.pop()
                    ids = shorter
                return ids

    def _build_prompts(self) -> None:
        s, n = self.sizes, len(self.lines)
        self.w1_ids = [self._chat_ids(self.lines[i % n]) for i in range(s.num_prompts)]
        self.w2_ids = self._long_prompt(0, s.w2_prompt_tokens)
        step = max(1, n // max(1, s.w3_num_prompts))
        self.w3_ids = [
            self._long_prompt(i * step, s.w3_prompt_tokens) for i in range(s.w3_num_prompts)
        ]

    def _needed_blocks(self, block_size: int) -> int:
        """KV blocks for the largest selected workload (they run one after the other)."""
        s, work = self.sizes, self.args.workloads

        def need(ids: list[list[int]], new: int) -> int:
            return sum(math.ceil((len(x) + new) / block_size) + 1 for x in ids)

        needs = [16]
        if "w1" in work:
            needs.append(need(self.w1_ids, s.max_new_tokens))
        if "w2" in work:
            needs.append(need([self.w2_ids], s.w2_new_tokens))
        if "w3" in work:
            needs.append(need(self.w3_ids, s.w3_new_tokens))
        return max(needs) + 8

    def _load_engine(self):
        from lmengine.config import EngineConfig
        from lmengine.engine.engine import Engine

        a = self.args
        knobs = {
            k: getattr(a, k)
            for k in ("block_size", "max_batch_size", "max_prefill_token_num", "num_gpu_blocks")
            if getattr(a, k, None) is not None
        }
        cfg = EngineConfig(dtype="float32", device="cpu", **knobs)
        if a.num_gpu_blocks is None:
            cfg.num_gpu_blocks = self._needed_blocks(cfg.block_size)
        self.engine_config = cfg
        _log(f"loading lmengine: {cfg}")
        return Engine.from_pretrained(self.path, cfg)

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        self.engine = None
        self.hf = None

    # ---- measuring ----------------------------------------------------------------------------
    def _measure(
        self,
        rows: list[Row],
        warmup: Callable[[], Any],
        run: Callable[[], list[float]],
    ) -> None:
        """Warm up once, then `repeat` timed runs; `run` returns one value per row."""
        self._measure_interleaved([(rows, warmup, run)])

    def _measure_interleaved(
        self, systems: list[tuple[list[Row], Callable[[], Any], Callable[[], list[float]]]]
    ) -> None:
        """Like `_measure` for several systems on one workload, their timed runs alternating
        (run 1 of each, then run 2 of each, ...): load that drifts during the benchmark (a
        shared machine) then reaches every system alike instead of whichever ran last."""
        failed: set[int] = set()

        def attempt(i: int, step: str, fn: Callable[[], Any]) -> Any:
            rows = systems[i][0]
            label = f"{rows[0].workload} {rows[0].system}"
            try:
                result = fn()
            except Exception as e:
                msg = f"{type(e).__name__}: {e}".strip()
                _log(f"{label}: FAILED: {msg}\n{traceback.format_exc()}")
                for row in rows:
                    row.error = msg
                failed.add(i)
                return None
            if step != "warm-up":
                shown = ", ".join(
                    f"{row.metric} {v:.2f}" for row, v in zip(rows, result, strict=True)
                )
                _log(f"{label}: {step}: {shown}")
            return result

        for i, (rows, warmup, _) in enumerate(systems):
            _log(f"{rows[0].workload} {rows[0].system}: warm-up")
            attempt(i, "warm-up", warmup)
        for r in range(self.repeat):
            for i, (rows, _, run) in enumerate(systems):
                if i in failed:
                    continue
                values = attempt(i, f"run {r + 1}/{self.repeat}", run)
                if values is not None:
                    for row, v in zip(rows, values, strict=True):
                        row.runs.append(v)
        for rows, _, _ in systems:
            self.rows.extend(rows)

    def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on lmengine's loop thread, between engine steps.

        NOTE: a second thread running parallel torch ops owns a second OpenMP pool, and with
        two pools small ops of whichever thread ran second were up to 2x slower on 2 cores
        (most likely libgomp throttling its spin-waits). transformers therefore runs on the
        same thread as lmengine's forwards (the engine is idle meanwhile), so neither system
        pays for the other and each runs as it would alone. (transformers' generate_batch
        starts a thread of its own, which this cannot avoid.)
        """
        return self.engine.call(fn, timeout=None)

    def _hf_generate(self, ids: list[list[int]], new: int) -> float:
        """Seconds of one left-padded static-batch `generate` making exactly `new` tokens."""
        torch = self.torch
        enc = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")

        def run():
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = self.hf.generate(
                    input_ids=enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
                return out, time.perf_counter() - t0

        out, dt = self._on_engine_thread(run)
        made = out.shape[1] - enc["input_ids"].shape[1]
        if made != new:
            raise BenchError(f"transformers generate made {made} tokens per prompt, not {new}")
        return dt

    def _lm_batch(self, ids: list[list[int]], new: int) -> float:
        """Seconds for lmengine's Pipeline to finish every prompt with exactly `new` tokens."""
        from lmengine.api import Pipeline
        from lmengine.config import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        outs = Pipeline(self.engine)(ids, gen_config=cfg)
        dt = time.perf_counter() - t0
        for o in outs:
            if o.finish_reason == "error" or o.generate_token_len != new:
                raise BenchError(
                    f"lmengine prompt {o.index}: finish_reason={o.finish_reason} "
                    f"tokens={o.generate_token_len} (want {new}) error={o.error}"
                )
        return dt

    # ---- W1 -----------------------------------------------------------------------------------
    def w1(self) -> None:
        s = self.sizes
        ids, new = self.w1_ids, s.max_new_tokens
        total = len(ids) * new
        warm_ids, warm_new = ids[: min(4, len(ids))], min(8, new)
        title = "W1"
        self.workload_desc[title] = (
            f"offline batch: {len(ids)} chat prompts ({min(map(len, ids))}-{max(map(len, ids))} "
            f"tokens) submitted at once, {new} new tokens each, EOS ignored; output tok/s"
        )

        row = Row(title, LM, "output tok/s")
        hf_row = Row(title, HF_STATIC, "output tok/s", note="generate, left-padded batch")
        self._measure_interleaved(
            [
                (
                    [row],
                    lambda: self._lm_batch(warm_ids, warm_new),
                    lambda: [total / self._lm_batch(ids, new)],
                ),
                (
                    [hf_row],
                    lambda: self._hf_generate(warm_ids, warm_new),
                    lambda: [total / self._hf_generate(ids, new)],
                ),
            ]
        )
        try:
            row.note = f"preemptions={self.engine.stats()['num_preemptions']}"
        except Exception as e:  # the engine may be dead after a failure
            row.note = f"stats unavailable: {e!r}"
        if not self.args.skip_hf_batch:  # run last: see `transformers_cb`
            self._pending_cb = (title, ids, new, warm_ids, warm_new)

    def transformers_cb(self) -> None:
        """W1 through transformers' `generate_batch`, after every other measurement: its
        thread runs torch ops, and while a thread that owns an OpenMP pool lives, libgomp
        (more pool threads than cores) stops spin-waiting, which made lmengine's single-stream
        decode ~30 % slower in this process."""
        pending = getattr(self, "_pending_cb", None)
        if pending is not None:
            self._pending_cb = None
            self._w1_hf_cb(*pending)
            order = {w.upper(): i for i, w in enumerate(WORKLOADS)}
            self.rows.sort(key=lambda row: order.get(row.workload, len(order)))

    def _w1_hf_cb(
        self, title: str, ids: list[list[int]], new: int, warm_ids: list[list[int]], warm_new: int
    ) -> None:
        """transformers continuous batching. The manager is kept between calls
        (persistent_manager=True), so the timed calls exclude its one-time setup (KV cache
        allocation and warm-up), as lmengine's timing excludes building the engine."""
        from transformers import ContinuousBatchingConfig
        from transformers import GenerationConfig as HFGenerationConfig

        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        page = 256
        num_blocks = sum(math.ceil((len(x) + new) / page) for x in ids) + 4
        max_tokens = self.engine_config.max_prefill_token_num
        cb_config = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=num_blocks,
            max_batch_tokens=max_tokens,
            max_requests_per_batch=min(self.engine_config.max_batch_size, max_tokens),
        )
        row = Row(title, HF_CB, "output tok/s")
        row.note = (
            f"generate_batch, sdpa, page_size={page} num_blocks={num_blocks} "
            f"max_batch_tokens={max_tokens}; setup excluded"
        )

        def call(batch: list[list[int]], n: int) -> float:
            gen = HFGenerationConfig(
                max_new_tokens=n,
                eos_token_id=-1,  # never stop early: exactly n tokens, like ignore_eos
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
            t0 = time.perf_counter()
            out = self.hf.generate_batch(
                inputs=batch,
                generation_config=gen,
                continuous_batching_config=cb_config,
                persistent_manager=True,
            )
            dt = time.perf_counter() - t0
            self._check_cb(out, len(batch), n)
            return dt

        t0 = time.perf_counter()
        try:
            self._measure(
                [row],
                lambda: call(warm_ids, warm_new),
                lambda: [len(ids) * new / call(ids, new)],
            )
        finally:
            try:
                self.hf.destroy_cached_continuous_batching_manager()
            except Exception as e:  # report, but keep the rest of the run
                _log(f"destroying the transformers CB manager failed: {e!r}")
        self.setup["transformers_cb_wall_s"] = round(time.perf_counter() - t0, 2)

    def _check_cb(self, out: dict, n_inputs: int, new: int) -> None:
        errors = {r.error for r in out.values() if getattr(r, "error", None)}
        if errors:
            raise BenchError(f"generate_batch request error: {sorted(errors)[0]}")
        if len(out) != n_inputs:
            manager = getattr(self.hf, "_cached_continuous_batching_manager", None)
            status = getattr(manager, "background_thread_status", None)
            fatal = getattr(status, "fatal_error", None)
            why = f": {type(fatal).__name__}: {fatal}" if fatal is not None else ""
            raise BenchError(f"generate_batch returned {len(out)} of {n_inputs} results{why}")
        lengths = {len(r.generated_tokens) for r in out.values()}
        if lengths != {new}:
            raise BenchError(f"generate_batch made {sorted(lengths)} tokens per prompt, not {new}")

    # ---- W2 -----------------------------------------------------------------------------------
    def w2(self) -> None:
        ids, new = self.w2_ids, self.sizes.w2_new_tokens
        title = "W2"
        self.workload_desc[title] = (
            f"single stream: one {len(ids)}-token chat prompt, {new} new tokens; "
            "TTFT and decode tok/s = (n-1) / (t_last - t_first)"
        )

        lm_rows = [
            Row(title, LM, "TTFT ms", higher_is_better=False, note="EngineInstance.stream_infer"),
            Row(title, LM, "decode tok/s", note="EngineInstance.stream_infer"),
        ]

        def hf_run() -> list[float]:
            ttft = self._hf_generate([ids], 1)
            full = self._hf_generate([ids], new)
            if full <= ttft:
                raise BenchError(f"generate({new}) took {full:.3f} s <= generate(1) {ttft:.3f} s")
            return [ttft * 1000, (new - 1) / (full - ttft)]

        hf_rows = [
            Row(title, HF_STATIC, "TTFT ms", higher_is_better=False, note="generate(1)"),
            Row(title, HF_STATIC, "decode tok/s", note="(N-1) / (t generate(N) - t generate(1))"),
        ]
        self._measure_interleaved(
            [
                (lm_rows, lambda: self._lm_stream(ids, 4), lambda: self._lm_stream(ids, new)),
                (hf_rows, lambda: self._hf_generate([ids], 4), hf_run),
            ]
        )

    def _lm_stream(self, ids: list[int], new: int) -> list[float]:
        """[TTFT ms, decode tok/s] of one request streamed through an EngineInstance."""
        from lmengine.config import GenerationConfig

        inst = self.engine.create_instance()
        session_id = self.engine.new_session_id()
        cfg = GenerationConfig(max_new_tokens=new, ignore_eos=True)
        stamps: list[float] = []
        seen = 0
        last = None
        t0 = time.perf_counter()
        for r in inst.stream_infer(session_id, ids, gen_config=cfg):
            now = time.perf_counter()
            if r.finish_reason == "error":
                raise BenchError(f"lmengine stream error: {r.error}")
            if len(r.token_ids) > seen:
                stamps.extend([now] * (len(r.token_ids) - seen))
                seen = len(r.token_ids)
            last = r
        inst.end(session_id)
        if last is None or seen != new:
            raise BenchError(f"lmengine streamed {seen} tokens, not {new}")
        decode_s = stamps[-1] - stamps[0]
        return [(stamps[0] - t0) * 1000, (new - 1) / decode_s if decode_s > 0 else 0.0]

    # ---- W3 -----------------------------------------------------------------------------------
    def w3(self) -> None:
        ids, new = self.w3_ids, self.sizes.w3_new_tokens
        total = sum(len(x) for x in ids)
        lens = f"{min(map(len, ids))}-{max(map(len, ids))}"
        title = "W3"
        self.workload_desc[title] = (
            f"prefill: {len(ids)} chat prompts of {lens} tokens ({total} in all), {new} new "
            "tokens; prompt tok/s until every request has its first token"
        )
        warm = ids[: min(2, len(ids))]

        row = Row(title, LM, "prefill tok/s", note="Pipeline.stream_infer, first delta each")
        hf_row = Row(title, HF_STATIC, "prefill tok/s", note="generate(1), left-padded batch")
        self._measure_interleaved(
            [
                ([row], lambda: self._lm_first_tokens(warm, 2), lambda: [self._lm_w3(total)]),
                (
                    [hf_row],
                    lambda: self._hf_generate(warm, 1),
                    lambda: [total / self._hf_generate(ids, 1)],
                ),
            ]
        )

    def _lm_w3(self, total: int) -> float:
        return total / self._lm_first_tokens(self.w3_ids, self.sizes.w3_new_tokens)

    def _lm_first_tokens(self, ids: list[list[int]], new: int) -> float:
        """Seconds until every prompt has its first token (the stream is run to its end)."""
        from lmengine.api import Pipeline
        from lmengine.config import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=new, ignore_eos=True)
        first: dict[int, float] = {}
        counts = [0] * len(ids)
        t0 = time.perf_counter()
        for d in Pipeline(self.engine).stream_infer(ids, gen_config=cfg):
            now = time.perf_counter()
            if d.finish_reason == "error":
                raise BenchError(f"lmengine prompt {d.index}: {d.error}")
            if d.token_ids and d.index not in first:
                first[d.index] = now
            counts[d.index] += len(d.token_ids)
        if len(first) != len(ids) or set(counts) != {new}:
            raise BenchError(f"lmengine generated {counts} tokens, want {new} each")
        return max(first.values()) - t0

    # ---- report -------------------------------------------------------------------------------
    def find(self, workload: str, system: str, metric: str) -> Row | None:
        for row in self.rows:
            if row.workload == workload and row.system == system:
                if row.metric == metric and row.error is None:
                    return row
        return None

    def ratios(self) -> dict[str, float | None]:
        """lmengine over each transformers system, best runs (>1: lmengine better)."""
        out: dict[str, float | None] = {}
        pairs = [
            ("W1", "output tok/s", HF_STATIC, "w1 lmengine / transformers static"),
            ("W1", "output tok/s", HF_CB, "w1 lmengine / transformers generate_batch"),
            ("W2", "TTFT ms", HF_STATIC, "w2 TTFT: transformers / lmengine"),
            ("W2", "decode tok/s", HF_STATIC, "w2 decode lmengine / transformers"),
            ("W3", "prefill tok/s", HF_STATIC, "w3 prefill lmengine / transformers static"),
        ]
        for wl, metric, other, key in pairs:
            lm = self.find(wl, LM, metric)
            if not any(r.workload == wl and r.system == other for r in self.rows):
                continue  # not run (workload not selected, or --skip-hf-batch)
            out[key] = lm.speedup_over(self.find(wl, other, metric)) if lm else None
        return out


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _table(bench: Bench) -> tuple[list[str], list[list[str]]]:
    header = ["workload", "system", "metric", "best", "median", "vs transformers static", "note"]
    lines = []
    for row in bench.rows:
        base = bench.find(row.workload, HF_STATIC, row.metric)
        ratio = row.speedup_over(base) if row.error is None else None
        note = f"ERROR: {row.error}" if row.error else row.note
        lines.append(
            [
                row.workload,
                row.system,
                row.metric,
                _fmt(row.best),
                _fmt(row.median),
                _fmt(ratio, 2),
                note,
            ]
        )
    return header, lines


def _plain(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    widths[-1] = 0  # the note column is not padded
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), "  ".join("-" * max(w, 4) for w in widths)]
    out += [fmt.format(*r).rstrip() for r in lines]
    return "\n".join(out)


def _markdown(header: list[str], lines: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    align = ["---", "---", "---", "---:", "---:", "---:", "---"]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in lines]
    return "\n".join(out)


def _report(bench: Bench, info: dict[str, Any], command: str, ratios: dict) -> str:
    header, lines = _table(bench)
    machine = (
        f"{info['cpu']}, {info['cpu_count']} cores; torch {info['torch']} "
        f"({info['torch_threads']} threads), transformers {info['transformers']}, "
        f"lmengine {info['lmengine']}, Python {info['python']}; "
        f"load average at start {info['loadavg_at_start']}"
    )
    cfg = bench.engine_config
    engine = (
        f"block_size={cfg.block_size} max_batch_size={cfg.max_batch_size} "
        f"max_prefill_token_num={cfg.max_prefill_token_num} num_gpu_blocks={cfg.num_gpu_blocks}"
    )
    how = (
        f"1 untimed warm-up + {bench.repeat} timed run(s) per measurement, lmengine and "
        "transformers static runs alternating; "
        "'vs transformers static' = best run / best transformers static run "
        "(TTFT inverted: > 1 means lmengine is faster)"
    )
    workloads = [f"{k}: {v}" for k, v in bench.workload_desc.items()]
    ratio_lines = [f"{k}: {_fmt(v, 2)}" for k, v in ratios.items()]
    parts = [
        "== lmengine vs transformers (float32, CPU, one process) ==",
        f"command:  {command}",
        f"machine:  {machine}",
        f"model:    {bench.path}",
        f"engine:   {engine}",
        f"runs:     {how}",
        *[f"workload {w}" for w in workloads],
        "",
        _plain(header, lines),
        "",
        "lmengine over transformers (best runs, > 1: lmengine better):",
        *[f"  {r}" for r in ratio_lines],
        "",
        "---- markdown ----",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Model: `{bench.path}`, float32; lmengine {engine}  ",
        f"{how}.",
        "",
        *[f"- {w}" for w in workloads],
        "",
        _markdown(header, lines),
        "",
        "lmengine over transformers (best runs, > 1: lmengine better):",
        "",
        *[f"- {r}" for r in ratio_lines],
        "",
    ]
    return "\n".join(parts)


def run_benchmarks(args: argparse.Namespace) -> int:
    """Run the selected workloads, print the report, maybe write JSON; 1 if lmengine failed."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    command = _command_line()
    info = _machine_info()
    bench = Bench(args)
    try:
        bench.load()
        for name in args.workloads:
            getattr(bench, name)()
        bench.transformers_cb()
    finally:
        bench.close()
    ratios = bench.ratios()
    print(_report(bench, info, command, ratios), flush=True)
    if args.json:
        result = {
            "command": command,
            "machine": info,
            "model": bench.path,
            "engine_config": asdict(bench.engine_config),
            "sizes": asdict(bench.sizes),
            "repeat": bench.repeat,
            "workloads": args.workloads,
            "workload_desc": bench.workload_desc,
            "setup": bench.setup,
            "rows": [r.to_dict() for r in bench.rows],
            "ratios": ratios,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        _log(f"wrote {args.json}")
    failed = any(r.system == LM and r.error for r in bench.rows)
    return 1 if failed else 0
