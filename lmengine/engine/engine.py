"""The Engine: one RequestManager, one Scheduler, one ModelAgent and the step loop.

The loop runs in one background thread and is the only code that touches the Scheduler and
the model. One request, from the caller to its last response:

1. `EngineInstance.stream_infer` builds an AddRequest; `RequestManager.submit` validates it in
   the caller's thread (`RequestValidator.validate`) and queues it.
2. The loop drains it (`_handle` -> `_add`): the request gets its record (`RequestRecord`, in
   `self.requests`: the request, its Sequence, its output state, its beam group) and its
   Sequence joins the Scheduler.
3. Each `step()`: the Scheduler picks the batch (`schedule`), the ModelAgent runs it
   (`execute`: StepInput -> ModelOutput), the output stage checks stops and builds Responses
   (`process`), the Scheduler takes the tokens back (`update`), beam groups advance, and the
   RequestManager hands each Response to its caller's queue (`publish_many`).
4. A request ends in one place, `_release`: its record is dropped and its sequences freed,
   after its last Response is out (finished), or with it (`_end`: cancelled, failed). A
   fault anywhere in a step fails that step's requests only (`_fail_step`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable

import torch

from lmengine.config import EngineConfig
from lmengine.engine import collector
from lmengine.engine.adapters import LoraAdmin
from lmengine.engine.beam import BeamSearch
from lmengine.engine.client import Client
from lmengine.engine.loader import load_model_and_tokenizer
from lmengine.engine.malloc import IDLE_RELEASE_S, keep_freed_memory, release_idle_memory
from lmengine.engine.model_agent import ModelAgent
from lmengine.engine.observer import StepReport, step_report
from lmengine.engine.output_stage import OutputProcessor
from lmengine.engine.record import RequestRecord
from lmengine.engine.request import (
    STEP_FAILED,
    AddRequest,
    CallRequest,
    CancelRequest,
    FatalEngineError,
    Request,
    RequestError,
    RequestManager,
    error_response,
)
from lmengine.engine.step import StepInput
from lmengine.engine.validation import RequestValidator
from lmengine.models.model_info import ModelInfo
from lmengine.scheduler import (
    BlockManager,
    Scheduler,
    SchedulerOutput,
    Sequence,
    get_policy,
)
from lmengine.scheduler.qos import QoS

logger = logging.getLogger("lmengine")
_MAX_FAILED_STEPS = 3  # consecutive failed steps before the loop gives up (a broken engine)


class Engine(LoraAdmin):
    """Serves generation requests from any number of threads with continuous batching.

    Holds no tensors itself: the ModelAgent owns weights and KV cache, the Scheduler owns
    sequences and blocks. Build with `Engine.from_pretrained`; talk to it through
    `create_instance()`; `close()` stops the loop and fails whatever is still outstanding.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        engine_config: EngineConfig | None = None,
        device: torch.device | None = None,
        model_path: str | None = None,
        *,
        loader: Callable[[], tuple] | None = None,
    ) -> None:
        """Give either a loaded HF `model` (and its tokenizer), or a `loader` returning
        (model, tokenizer, path, device) that runs on the loop thread."""
        if (model is None) == (loader is None):
            raise ValueError("give exactly one of model and loader")
        self.engine_config = engine_config or EngineConfig()
        self.model_path = model_path
        self._stop = threading.Event()
        self._stop_reason = "engine closed"  # what requests still running are told at the end
        self._observers: tuple[Callable[[StepReport], None], ...] = ()  # swapped whole
        self._added: list[int] = []  # request ids taken in since the last step (observers)
        self._ended: list[int] = []  # request ids released since the last step (observers)
        self._failed_steps = 0  # consecutive steps that raised
        self._grammar_compiler = None  # structured outputs: built on first use
        self._grammar_lock = threading.Lock()
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(loader or (lambda: (model, tokenizer, model_path, device)),),
            name="lmengine-loop",
            daemon=True,
        )
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    def _build(self, loader: Callable[[], tuple]) -> None:
        """Load and patch the model, size the KV pool, build the scheduler (loop thread).

        NOTE: every torch op of the engine runs on this thread, loading and weight packing
        included. A second thread that has run parallel torch ops owns an OpenMP pool of its
        own, and with two pools on two cores this thread's ops ran up to 2x slower (a decode
        step of one sequence: 64 ms here, 128 ms with the model loaded by the caller).
        """
        cfg = self.engine_config
        # NOTE: read the QoS file first: a malformed one fails before the model loads
        self._qos = QoS.from_file(cfg.qos_config_path) if cfg.qos_config_path else None
        model, tokenizer, path, device = loader()
        self.tokenizer = tokenizer
        self.model_path = path or self.model_path
        if cfg.tp > 1:  # every rank loads its own shard: see lmengine/distributed
            from lmengine.distributed import TPModelAgent

            if model is not None:
                raise ValueError("tp > 1 loads each rank's shard itself: use from_pretrained")
            self.model_agent = TPModelAgent(path, cfg, device, on_failure=self._fail_all)
            self.info = self.model_agent.info
        else:
            device = device or next(model.parameters()).device
            if device.type == "cpu":
                torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
                keep_freed_memory()
            self.info = ModelInfo.from_hf(model.config, getattr(model, "generation_config", None))
            self.model_agent = ModelAgent(model, self.info, cfg, device)
        num_blocks = self.model_agent.num_gpu_blocks
        if cfg.eviction_type == "swap" and not cfg.num_cpu_blocks:
            logger.warning("eviction_type='swap' with num_cpu_blocks=0: preempting by recompute")
        # NOTE: a sequence can never outgrow the whole KV pool, so cap its length there.
        wanted = cfg.session_len or self.info.max_position_embeddings
        self.session_len = min(wanted, num_blocks * cfg.block_size)
        if self.session_len < wanted:
            logger.warning(
                "session_len lowered from %d to %d tokens: the KV pool holds %d blocks of %d",
                wanted,
                self.session_len,
                num_blocks,
                cfg.block_size,
            )
        self.scheduler = Scheduler(
            BlockManager(num_blocks, cfg.num_cpu_blocks, cfg.block_size, cfg.enable_prefix_caching),
            get_policy(cfg.scheduling_policy, priority_aging_s=cfg.priority_aging_s),
            max_batch_size=cfg.max_batch_size,
            max_prefill_token_num=cfg.max_prefill_token_num,
            eviction_type=cfg.eviction_type,
            qos=self._qos,
            num_lookahead_slots=cfg.speculative.num_speculative_tokens if cfg.speculative else 0,
            max_seq_len=self.session_len,
            max_step_s=cfg.max_step_ms / 1000,
        )
        if cfg.adapters:
            pool = self.model_agent.lora
            self._enable_lora({name: pool.read(path) for name, path in cfg.adapters.items()})
        self.validator = RequestValidator(
            vocab_size=self.info.vocab_size,
            session_len=self.session_len,
            max_batch_size=cfg.max_batch_size,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            is_speculative=cfg.speculative is not None,
            adapter_names=self._served_adapters,
            qos=self._qos,
            num_layers=self.info.num_layers,
            hidden_size=self.info.hidden_size,
            compile_grammar=self._compile_grammar if self.tokenizer is not None else None,
        )
        self.num_steps = 0  # steps started; RequestMetrics count in these
        self.request_manager = RequestManager(self.validator.validate, lambda: self.num_steps)
        self.client = Client(self)  # the front door: every front end submits through it
        self.requests: dict[int, RequestRecord] = {}  # request id -> record (loop thread only)
        self.output_stage = OutputProcessor(self.tokenizer, self.info.eos_token_ids)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count(1 << 48)  # auto ids, far from user-chosen ones
        self.beam_search = BeamSearch(self.scheduler, self.info.eos_token_ids, self._seq_ids)

    def _compile_grammar(self, spec: dict):
        """Any thread: a `structured_outputs` spec compiled for this model (xgrammar, built on
        first use; it caches compiled grammars)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from lmengine.engine.structured import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.info.vocab_size, self.info.eos_token_ids
                )
        return self._grammar_compiler.compile(spec)

    def _run(self, loader: Callable[[], tuple]) -> None:
        try:
            self._build(loader)
        except BaseException as e:
            self._init_error = e
            self._ready.set()
            return
        collector.freeze()  # NOTE: the loaded heap out of every full collection's way
        self._ready.set()
        try:
            self._loop()
        finally:
            self.model_agent.close()
            collector.thaw()

    @classmethod
    def from_pretrained(
        cls, model_path: str | None = None, engine_config: EngineConfig | None = None
    ) -> Engine:
        """Load a folder, hub id or GGUF file (None: the default model) and start the loop."""
        cfg = engine_config or EngineConfig()
        load = functools.partial(load_model_and_tokenizer, quant_policy=cfg.quant_policy)
        if cfg.tp > 1:  # the model agent loads the shards
            from lmengine.distributed.load import load_tokenizer as load
        return cls(
            engine_config=cfg,
            model_path=model_path,
            loader=lambda: load(model_path, cfg.dtype, cfg.device, cfg.trust_remote_code),
        )

    def create_instance(self):
        from lmengine.engine.instance import EngineInstance

        return EngineInstance(self)

    def new_request_id(self) -> int:
        """A fresh request id (any thread), far from the session ids callers choose."""
        return next(self._request_ids)

    new_session_id = new_request_id  # lmdeploy's name: an id for a one-request session

    # ---- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._stop.is_set() and not self._thread.is_alive():
            return
        self._stop.set()
        self.request_manager.wake()
        self._thread.join()
        self.request_manager.close("engine closed")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fail_all(self, reason: str) -> None:
        """Any thread: fail every request and stop the loop (a tensor-parallel worker died):
        the inbox's requests are answered here, the running ones as the loop ends."""
        self._stop_reason = reason
        self._stop.set()
        request_manager = getattr(self, "request_manager", None)
        if request_manager is not None:
            request_manager.close(reason)

    @property
    def is_alive(self) -> bool:
        """The loop runs and nothing has stopped it. NOTE: false as soon as a failure stops
        it (a dead tensor-parallel worker, the loop's death), while the thread may still be
        tearing down (a process group can take long to destroy)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def call(self, fn, timeout: float | None = 60.0):
        """Run `fn()` on the loop thread between steps and return its result."""
        result: queue.Queue = queue.Queue()
        self.request_manager.submit(CallRequest(fn, result))
        ok, value = result.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def check_integrity(self) -> None:
        """Assert that every KV block is owned exactly by the live sequences (loop-thread safe)."""
        self.call(self.scheduler.check_integrity)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block no request uses (as vLLM's `reset_prefix_cache`):
        later requests recompute those prefixes. Returns the number of blocks dropped."""
        return self.call(self.scheduler.block_manager.reset_prefix_cache)

    def stats(self) -> dict:
        """Scheduler counters (see `Scheduler.stats`): queue lengths incl. `num_swapped`, free
        blocks of both pools, preemptions, per-group QoS counters under "qos", `max_lora_slots`
        and, once an adapter is loaded, the LoRA pool's counters, once a grammar is compiled the
        bytes its cache holds (`grammar_cache_bytes`), and with speculative decoding the
        acceptance counters under "speculative"."""

        def collect() -> dict:
            sched = self.scheduler
            stats = sched.stats()
            stats["num_steps"] = self.num_steps
            stats["max_lora_slots"] = self.engine_config.max_lora_slots
            if sched.adapter_manager is not None:
                stats["num_adapter_host_reads"] = self.model_agent.lora.num_reads
                stats["num_host_adapters"] = len(self.model_agent.lora.host)
                # names, as vLLM's lora_requests_info labels them (read by inference gateways)
                stats["running_adapters"] = _adapter_names(sched.running)
                stats["waiting_adapters"] = _adapter_names([*sched.waiting, *sched.swapped])
            if self._grammar_compiler is not None:
                stats["grammar_cache_bytes"] = self._grammar_compiler.cache_bytes()
            speculative = self.model_agent.speculative_stats()
            if speculative is not None:
                stats["speculative"] = speculative
            return stats

        return self.call(collect)

    # ---- observers ------------------------------------------------------------------------------
    def add_observer(self, fn: Callable[[StepReport], None]) -> None:
        """Call `fn(report)` on the loop thread after every step (engine/observer.py)."""
        self._observers = (*self._observers, fn)

    def remove_observer(self, fn: Callable[[StepReport], None]) -> None:
        self._observers = tuple(f for f in self._observers if f is not fn)

    def _report(self, out: SchedulerOutput | None, started: float, error: str | None) -> None:
        """Hand the step's report to every observer (built only when there is one)."""
        report = step_report(
            self.num_steps, started, out, self._added, self._ended, error, self.scheduler.stats
        )
        self._added, self._ended = [], []
        for fn in self._observers:
            try:
                fn(report)
            except Exception:
                logger.error("step observer failed; removed:\n%s", traceback.format_exc())
                self.remove_observer(fn)

    # ---- the loop thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        release_at: float | None = None  # when idle memory goes back to the OS (malloc.py)
        try:
            while not self._stop.is_set():
                idle = not self.scheduler.has_unfinished
                if idle and release_at is not None and time.monotonic() >= release_at:
                    release_idle_memory()
                    release_at = None
                for req in self.request_manager.drain(block=idle):
                    self._handle(req)
                if idle and self.scheduler.has_unfinished:
                    self._gather_burst()
                if self.scheduler.has_unfinished:
                    self.step()
                    release_at = time.monotonic() + IDLE_RELEASE_S
        except BaseException as e:  # NOTE: any death of the loop must reach every caller
            logger.error("engine loop died:\n%s", traceback.format_exc())
            self._stop_reason = f"engine loop died: {type(e).__name__}: {e}"
            self._stop.set()  # is_alive is false from here on
        finally:
            self.request_manager.close(self._stop_reason)  # refuses new ones, answers the inbox
            for record in self.requests.values():  # NOTE: no scheduler call: it may be broken
                self.request_manager.deliver(
                    record.request, error_response(record.request, self._stop_reason)
                )
            self.requests.clear()

    def _gather_burst(self) -> None:
        """Take a burst arriving at an idle engine into its first step (`RequestManager.burst`),
        until the waiting prompts fill a step: else the burst's first prompt or two would run
        alone, and every other prompt of the burst would wait that step out too."""
        cfg, sched = self.engine_config, self.scheduler
        wait_s, gap_s = cfg.burst_wait_ms / 1000, cfg.burst_gap_ms / 1000
        for got in self.request_manager.burst(
            wait_s, gap_s, sched.waiting, lambda: self._stop.is_set() or sched.waiting_fill_a_step()
        ):
            for req in got:
                self._handle(req)

    def _handle(self, req: Request) -> None:
        if isinstance(req, AddRequest):
            self._add(req)
        elif isinstance(req, CancelRequest):
            record = self.requests.get(req.request_id)
            if record is not None:
                self._end(record, "cancel")
        elif isinstance(req, CallRequest):
            try:
                req.result_queue.put((True, req.fn()))
            except Exception as e:
                req.result_queue.put((False, e))

    def _add(self, req: AddRequest) -> None:
        req.metrics.arrival_time = time.monotonic()
        try:
            adapter_id = self.validator.admit(req, self.requests, self.scheduler.adapter_manager)
        except RequestError as e:
            self.request_manager.deliver(req, error_response(req, str(e)))
            return
        research = req.research
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=req.request_id,
            token_ids=list(req.input_ids),
            gen_config=req.gen_config,
            priority=req.priority,
            user_id=req.user_id,
            adapter_name=req.adapter_name,
            adapter_id=adapter_id,
            # prefix caching: see ResearchSpec.max_cached_tokens
            max_cached_tokens=research.max_cached_tokens if research is not None else None,
            shares_cache=research is None or not research.steering,
            research=research,
            grammar=req.grammar,
        )
        record = RequestRecord(req, seq, self.output_stage.new_state(req, seq))
        if req.gen_config.num_beams > 1:
            record.beams = self.beam_search.new_group(seq)
        self.scheduler.add_sequence(seq)
        self.requests[req.request_id] = record
        if self._observers:
            self._added.append(req.request_id)

    def _end(self, record: RequestRecord, reason: str, error: str | None = None) -> None:
        """End a request outside a step's results (cancelled, failed): free it, then give its
        caller the last Response."""
        final = self.output_stage.final_response(record, reason, error)
        self._release(record)
        self.request_manager.deliver(record.request, final)

    def _release(self, record: RequestRecord) -> None:
        """The one teardown: drop the request's record and free every sequence it still has
        (a finished sequence is freed already: `remove_sequence` is idempotent)."""
        self.requests.pop(record.request_id, None)
        for seq in record.sequences():
            self.scheduler.remove_sequence(seq)
        if self._observers:
            self._ended.append(record.request_id)

    def _beam_groups(self) -> list:
        return [r.beams for r in self.requests.values() if r.beams is not None]

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> SchedulerOutput | None:
        """Schedule, run, process outputs, update, publish. A fault in any of them fails the
        requests of this step (finish_reason "error", their blocks freed) and the engine goes
        on; only a failure it cannot contain (a tensor-parallel rank lost mid-step, or
        failures step after step) stops the loop."""
        plan, error = None, None
        self.num_steps += 1
        started = time.monotonic()
        try:
            plan = self.scheduler.schedule()
            model_out = self.model_agent.execute(StepInput.from_output(plan))
            result = self.output_stage.process(
                plan, model_out, self.requests, self.num_steps, started
            )
            self.scheduler.update(plan, result.new_tokens, result.finished)
            done = self.beam_search.advance(model_out.beam_rows, self._beam_groups())
            self.output_stage.beam_responses([self.requests[g.request_id] for g in done], result)
            self.request_manager.publish_many(result.responses)
            for request_id in result.ended:
                self._release(self.requests[request_id])
        except FatalEngineError:
            raise
        except Exception as e:
            error = self._fail_step(plan, e)
        else:
            self._failed_steps = 0
            self.scheduler.observe_step(plan, time.monotonic() - started)
        if self._observers:
            self._report(plan, started, error)
        return plan

    def _fail_step(self, out: SchedulerOutput | None, e: Exception) -> str:
        """Fail every request the step touched (every live one when scheduling itself failed)
        and free what they hold; if the scheduler is left inconsistent, or steps keep failing,
        stop the loop (every waiting caller then gets an error). Returns the requests' error."""
        self._failed_steps += 1
        logger.error("step failed; failing its requests:\n%s", traceback.format_exc())
        message = f"{STEP_FAILED}: {type(e).__name__}: {e}"
        request_ids = out.request_ids if out is not None else set(self.requests)
        for request_id in sorted(request_ids):
            record = self.requests.get(request_id)
            if record is not None:  # NOTE: one whose last Response is out was released
                self._end(record, "error", message)
        self.scheduler.check_integrity()
        if self._failed_steps >= _MAX_FAILED_STEPS:
            raise FatalEngineError(f"{_MAX_FAILED_STEPS} steps in a row failed: {message}")
        return message


def _adapter_names(seqs) -> list[str]:
    return sorted({seq.adapter_name for seq in seqs if seq.adapter_name is not None})
