"""The systems under test, loaded once in one process: lmengine (one Engine, driven through
`Pipeline` and `EngineInstance`) and transformers (one model: static-batch `generate` and
continuous-batching `generate_batch`). Each call times one piece of work and raises BenchError
when a system made other work than asked."""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from lmengine.bench.flags import Sizes
from lmengine.bench.measure import log
from lmengine.bench.prompts import Prompts, read_lines
from lmengine.bench.results import BenchError


class Systems:
    """Owns the tokenizer, the prompts, lmengine's Engine and the transformers model, and times
    one call of either system at a time. It never decides what is measured or how often: the
    workloads (`lmengine.bench.workloads`) do."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        import torch

        self.args = args
        self.sizes = sizes
        self.lines = read_lines(args.prompt_file)
        self.setup: dict[str, Any] = {}
        self.torch = torch
        torch.set_num_threads(os.cpu_count() or 1)

    # ---- loading ------------------------------------------------------------------------------
    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lmengine.engine.loader import resolve_model_path

        self.path = resolve_model_path(self.args.model)
        log(f"model: {self.path}")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.prompts = Prompts.build(self.tokenizer, self.lines, self.sizes)

        t0 = time.perf_counter()
        self.engine = self._load_engine()
        self.setup["lmengine_load_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        self.hf = self.on_engine_thread(
            lambda: (
                AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
                .eval()
                .requires_grad_(False)
            )
        )
        self.setup["transformers_load_s"] = round(time.perf_counter() - t0, 2)
        self.setup["transformers_attn_implementation"] = self.hf.config._attn_implementation
        torch.set_num_threads(os.cpu_count() or 1)

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
            cfg.num_gpu_blocks = self.prompts.needed_blocks(self.sizes, a.workloads, cfg.block_size)
        self.engine_config = cfg
        log(f"loading lmengine: {cfg}")
        return Engine.from_pretrained(self.path, cfg)

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        self.engine = None
        self.hf = None

    def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on lmengine's loop thread, between engine steps.

        NOTE: a second thread running parallel torch ops owns a second OpenMP pool, and with
        two pools small ops of whichever thread ran second were up to 2x slower on 2 cores
        (most likely libgomp throttling its spin-waits). transformers therefore runs on the
        same thread as lmengine's forwards (the engine is idle meanwhile), so neither system
        pays for the other and each runs as it would alone. (transformers' generate_batch
        starts a thread of its own, which this cannot avoid.)
        """
        return self.engine.call(fn, timeout=None)

    # ---- lmengine -----------------------------------------------------------------------------
    def lm_batch(self, ids: list[list[int]], new: int) -> float:
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

    def lm_stream(self, ids: list[int], new: int) -> list[float]:
        """[TTFT ms, decode tok/s] of one request streamed through an EngineInstance."""
        from lmengine.config import GenerationConfig

        inst = self.engine.create_instance()
        session_id = self.engine.new_request_id()
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

    def lm_first_tokens(self, ids: list[list[int]], new: int) -> float:
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

    # ---- transformers -------------------------------------------------------------------------
    def hf_generate(self, ids: list[list[int]], new: int) -> float:
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

        out, dt = self.on_engine_thread(run)
        made = out.shape[1] - enc["input_ids"].shape[1]
        if made != new:
            raise BenchError(f"transformers generate made {made} tokens per prompt, not {new}")
        return dt

    def hf_cb_config(self, ids: list[list[int]], new: int) -> tuple[Any, str]:
        """transformers' ContinuousBatchingConfig for `ids` with `new` tokens each (pages for
        all of them, lmengine's token and batch budgets), and a note that describes it."""
        from transformers import ContinuousBatchingConfig

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
        note = (
            f"generate_batch, sdpa, page_size={page} num_blocks={num_blocks} "
            f"max_batch_tokens={max_tokens}; setup excluded"
        )
        return cb_config, note

    def hf_cb_generate(self, batch: list[list[int]], new: int, cb_config: Any) -> float:
        """Seconds of one `generate_batch` making exactly `new` tokens per prompt. The manager
        is kept between calls (persistent_manager=True), so the timed calls exclude its
        one-time setup (KV cache allocation and warm-up), as lmengine's timing excludes
        building the engine; `hf_cb_close` ends it."""
        from transformers import GenerationConfig as HFGenerationConfig

        gen = HFGenerationConfig(
            max_new_tokens=new,
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
        self._check_cb(out, len(batch), new)
        return dt

    def hf_cb_close(self) -> None:
        try:
            self.hf.destroy_cached_continuous_batching_manager()
        except Exception as e:  # report, but keep the rest of the run
            log(f"destroying the transformers CB manager failed: {e!r}")

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
