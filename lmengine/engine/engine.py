"""The Engine: one RequestManager, one Scheduler, one ModelAgent and the step loop.

The loop runs in one background thread and is the only code that touches the Scheduler and
the model. Each iteration: (1) drain requests, (2) schedule, (3) swap/copy blocks and run the
model, (4) sample, (5) update sequences and publish responses.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmengine.config import EngineConfig, GenerationConfig
from lmengine.engine.beam import BeamSearch, validate_beam_request
from lmengine.engine.detokenize import IncrementalDetokenizer
from lmengine.engine.loader import load_model_and_tokenizer
from lmengine.engine.lora_pool import DEFAULT_MAX_LORA_RANK
from lmengine.engine.model_agent import ModelAgent
from lmengine.engine.request import (
    STEP_FAILED,
    AddRequest,
    CallRequest,
    CancelRequest,
    EndRequest,
    Request,
    RequestError,
    RequestManager,
    Response,
    error_response,
)
from lmengine.engine.sampling import SampleResult
from lmengine.models.model_info import ModelInfo
from lmengine.scheduler import (
    AdapterManager,
    BlockManager,
    Scheduler,
    SchedulerOutput,
    Sequence,
    get_policy,
)
from lmengine.scheduler.qos import QoS, QoSError

logger = logging.getLogger("lmengine")
_MAX_FAILED_STEPS = 3  # consecutive failed steps before the loop gives up (a broken engine)


@dataclass(eq=False)
class _RequestState:
    """Engine-side state of one running request: its sequence, text and stop matching."""

    req: AddRequest
    seq: Sequence
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, float]] | None
    text: str | None = None

    def visible_text(self, finished: bool) -> str | None:
        """Text safe to show: while running, hold back a tail that may start a stop word."""
        words = self.req.gen_config.stop_words
        if finished or not words or self.text is None:
            return self.text
        hold = max(len(w) for w in words) - 1
        return self.text[: max(0, len(self.text) - hold)]

    def response(self, token_ids: list[int], finish_reason: str | None) -> Response:
        return Response(
            text=self.visible_text(finish_reason is not None),
            token_ids=token_ids,
            finish_reason=finish_reason,
            input_token_len=self.seq.num_prompt_tokens,
            generate_token_len=len(token_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )


class Engine:
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
        self._failed_steps = 0  # consecutive steps that raised
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
        )
        self._adapter_names: frozenset[str] = frozenset()  # read by _validate on any thread
        if cfg.adapters:
            self._enable_lora(cfg.adapters)
        self.request_manager = RequestManager(self._validate)
        self._states: dict[int, _RequestState] = {}  # session_id -> running request
        self._seq_ids = itertools.count()
        self._session_ids = itertools.count(1 << 48)  # auto ids, far from user-chosen ones
        self.beam_search = BeamSearch(
            self.scheduler, self.info.eos_token_ids, self._seq_ids, self.tokenizer
        )

    def _run(self, loader: Callable[[], tuple]) -> None:
        try:
            self._build(loader)
        except BaseException as e:
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        finally:
            self.model_agent.close()

    @classmethod
    def from_pretrained(
        cls, model_path: str | None = None, engine_config: EngineConfig | None = None
    ) -> Engine:
        """Load a folder, hub id or GGUF file (None: the default model) and start the loop."""
        cfg = engine_config or EngineConfig()
        load = load_model_and_tokenizer
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

    def new_session_id(self) -> int:
        return next(self._session_ids)

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
        """Any thread: fail every request and stop the loop (a tensor-parallel worker died)."""
        self._stop.set()
        request_manager = getattr(self, "request_manager", None)
        if request_manager is not None:
            request_manager.close(reason)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

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

    def stats(self) -> dict:
        """Scheduler counters (see `Scheduler.stats`): queue lengths incl. `num_swapped`, free
        blocks of both pools, preemptions, per-group QoS counters under "qos", and with
        speculative decoding the acceptance counters under "speculative"."""

        def collect() -> dict:
            stats = self.scheduler.stats()
            speculative = getattr(self.model_agent, "speculative_stats", lambda: None)()
            if speculative is not None:
                stats["speculative"] = speculative
            return stats

        return self.call(collect)

    # ---- LoRA adapters ------------------------------------------------------------------------
    def add_adapter(self, name: str, path: str) -> None:
        """Load the peft LoRA folder `path` as adapter `name`, between two steps. Raises
        ValueError when the name is taken or the adapter does not fit the base model."""
        self.call(lambda: self._add_adapters({name: path}), timeout=None)

    def remove_adapter(self, name: str) -> None:
        """Forget adapter `name`: new requests for it fail; running ones finish with it."""
        self.call(lambda: self._remove_adapter(name))

    @property
    def adapter_names(self) -> list[str]:
        return sorted(self._adapter_names)

    def _enable_lora(self, adapters: dict[str, str]) -> None:
        cfg = self.engine_config
        if cfg.quant_policy is not None:
            raise ValueError(
                f"LoRA adapters are not supported together with quant_policy={cfg.quant_policy!r}"
            )
        pool = self.model_agent.lora
        weights = {name: pool.read(path) for name, path in adapters.items()}
        # NOTE: sized for the configured adapters; for one added later, leave room for others
        ranks = [w.max_rank for w in weights.values()]
        rank = cfg.max_lora_rank or max(ranks if cfg.adapters else [*ranks, DEFAULT_MAX_LORA_RANK])
        self.scheduler.adapter_manager = AdapterManager(pool.enable(cfg.max_lora_slots, rank))
        self._register_adapters(weights)

    def _add_adapters(self, adapters: dict[str, str]) -> None:
        if self.scheduler.adapter_manager is None:
            self._enable_lora(adapters)
            return
        pool = self.model_agent.lora
        self._register_adapters({name: pool.read(path) for name, path in adapters.items()})

    def _register_adapters(self, weights: dict) -> None:
        manager = self.scheduler.adapter_manager
        for name, w in weights.items():
            self.model_agent.lora.store(manager.register(name, w.demand), w)
        self._adapter_names = frozenset(manager.ids)

    def _remove_adapter(self, name: str) -> None:
        manager = self.scheduler.adapter_manager
        if manager is None or name not in manager.ids:
            raise ValueError(f"unknown adapter {name!r}")
        manager.remove(name)
        self.scheduler.block_manager.forget_adapter(name)  # prefix caching: stale KV
        self._adapter_names = frozenset(manager.ids)

    # ---- validation (submitting thread; reads immutable state only) ---------------------------
    def _validate(self, req: AddRequest) -> None:
        if not isinstance(req.gen_config, GenerationConfig):
            raise RequestError(f"gen_config must be a GenerationConfig, got {req.gen_config!r}")
        try:
            req.gen_config.__post_init__()  # NOTE: fields may have been changed since creation
        except ValueError as e:
            raise RequestError(f"invalid generation config: {e}") from None
        ids = req.input_ids
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise RequestError("input_ids must be a list of integer token ids")
        if not ids:
            raise RequestError("empty prompt: input_ids has no tokens")
        bad = [t for t in ids if t < 0 or t >= self.info.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.info.vocab_size})"
            )
        if len(ids) >= self.session_len:
            raise RequestError(
                f"prompt of {len(ids)} tokens leaves no room to generate within "
                f"session_len={self.session_len}"
            )
        if req.adapter_name is not None and req.adapter_name not in self._adapter_names:
            loaded = ", ".join(sorted(self._adapter_names)) or "none"
            raise RequestError(f"unknown adapter {req.adapter_name!r} (loaded: {loaded})")
        if req.priority is not None and (
            isinstance(req.priority, bool) or not isinstance(req.priority, int)
        ):
            raise RequestError(f"priority must be an integer or None, got {req.priority!r}")
        validate_beam_request(
            req,
            self.scheduler.block_manager.device.num_blocks,
            self.engine_config.block_size,
            self.session_len,
            self.engine_config.max_batch_size,
            self.engine_config.speculative is not None,
        )
        if self._qos is not None:
            try:
                self._qos.tenant(req.user_id)
            except QoSError as e:
                raise RequestError(str(e)) from None

    # ---- the loop thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.scheduler.has_unfinished
                for req in self.request_manager.drain(block=idle):
                    self._handle(req)
                if self.scheduler.has_unfinished:
                    self.step()
        except BaseException as e:  # NOTE: any death of the loop must reach every caller
            logger.error("engine loop died:\n%s", traceback.format_exc())
            self.request_manager.close(f"engine loop died: {type(e).__name__}: {e}")

    def _handle(self, req: Request) -> None:
        if isinstance(req, AddRequest):
            self._add(req)
        elif isinstance(req, CancelRequest):
            self._finish_session(req.session_id, "cancel")
        elif isinstance(req, EndRequest):
            self._finish_session(req.session_id, "cancel")
            self.scheduler.end_session(req.session_id)
        elif isinstance(req, CallRequest):
            try:
                req.result_queue.put((True, req.fn()))
            except Exception as e:
                req.result_queue.put((False, e))

    def _add(self, req: AddRequest) -> None:
        if req.session_id in self._states:
            message = f"session {req.session_id} already has a running request"
            self.request_manager.publish(req, error_response(req, message))
            return
        seq = Sequence(
            seq_id=next(self._seq_ids),
            session_id=req.session_id,
            token_ids=list(req.input_ids),
            gen_config=req.gen_config,
            priority=req.priority,
            user_id=req.user_id,
            adapter_name=req.adapter_name,
        )
        if req.adapter_name is not None:
            manager = self.scheduler.adapter_manager
            seq.adapter_id = manager.id_of(req.adapter_name) if manager else None
            if seq.adapter_id is None:  # removed since the request was validated
                message = f"unknown adapter {req.adapter_name!r}: it was removed"
                self.request_manager.publish(req, error_response(req, message))
                return
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.input_ids, req.gen_config.skip_special_tokens
            )
        logprobs = [] if req.gen_config.logprobs is not None else None
        self._states[req.session_id] = _RequestState(
            req, seq, detok, logprobs, "" if detok else None
        )
        self.scheduler.add_sequence(seq)
        if req.gen_config.num_beams > 1:
            self.beam_search.add(seq, self.session_len)

    def _finish_session(self, session_id: int, reason: str, error: str | None = None) -> None:
        state = self._states.pop(session_id, None)
        if state is None:
            return
        state.seq = self.beam_search.best_running(session_id) or state.seq
        self.beam_search.abort(session_id)
        self.scheduler.abort_sequence(state.seq)
        self.model_agent.release(state.seq.seq_id)
        resp = state.response(list(state.seq.generated_token_ids), reason)
        resp.error = error
        self.request_manager.publish(state.req, resp)

    def step(self) -> SchedulerOutput:
        """One scheduling step: schedule, forward, sample, publish. A step that raises fails
        the requests it ran (finish_reason "error", their blocks freed) and the engine goes
        on; only a failure the engine cannot contain (tensor parallel ranks mid-collective,
        or failures step after step) stops the loop."""
        out = self.scheduler.schedule()
        try:
            self._run_step(out)
        except Exception as e:
            self._failed_steps += 1
            if self.engine_config.tp > 1 or self._failed_steps >= _MAX_FAILED_STEPS:
                raise
            logger.error("step failed; failing its requests:\n%s", traceback.format_exc())
            message = f"{STEP_FAILED}: {type(e).__name__}: {e}"
            for session_id in {item.seq.session_id for item in out.scheduled}:
                self._finish_session(session_id, "error", message)
        else:
            self._failed_steps = 0
        return out

    def _run_step(self, out: SchedulerOutput) -> None:
        self.beam_search.before_forward(out)
        results = self.model_agent.forward(out)
        new_tokens: dict[int, list[int]] = {}
        finished: list[Sequence] = []
        published: list[tuple[AddRequest, Response]] = []
        for item in out.scheduled:
            res = results.get(item.seq.seq_id)
            if res is None:
                continue
            state = self._states[item.seq.session_id]
            accepted: list[int] = []  # speculative decoding: several tokens per step
            for one in res if isinstance(res, list) else [res]:
                reason = self._check_stop(state, one, len(accepted))
                accepted.append(one.token_id)
                if reason is not None:
                    break
            new_tokens[item.seq.seq_id] = accepted
            token_ids = [*item.seq.generated_token_ids, *accepted]
            response = state.response(token_ids, reason)
            if self.engine_config.speculative is not None:
                stats = self.model_agent.speculative_stats(item.seq.seq_id)
                response.num_draft_tokens = stats["num_draft_tokens"]
                response.num_accepted_tokens = stats["num_accepted_tokens"]
            published.append((state.req, response))
            if reason is not None:
                finished.append(item.seq)
                del self._states[item.seq.session_id]
                self.model_agent.release(item.seq.seq_id)
        self.scheduler.update(out, new_tokens, finished)
        for session_id, group in self.beam_search.after_step(self.model_agent.beam_rows):
            state = self._states.pop(session_id)
            cfg = state.req.gen_config
            self.beam_search.abort(session_id)
            resp = self.beam_search.response(
                group, cfg.skip_special_tokens, cfg.num_return_sequences
            )
            published.append((state.req, resp))
        self.request_manager.publish_many(published)

    def _check_stop(self, state: _RequestState, res: SampleResult, pending: int = 0) -> str | None:
        """Record the sampled token in the request's text; return a finish reason or None.
        `pending`: tokens already accepted this step before this one (speculative decoding)."""
        seq, cfg, tok = state.seq, state.req.gen_config, res.token_id
        if state.logprobs is not None:
            state.logprobs.append(res.top_logprobs or {})
        scan_from = len(state.text) if state.text is not None else 0
        if state.detok is not None:
            state.detok.add(tok)
            state.text = state.detok.text
        num_generated = seq.num_generated_tokens + pending + 1
        if num_generated > cfg.min_new_tokens:
            if not cfg.ignore_eos and tok in self.info.eos_token_ids:
                return "stop"
            if cfg.stop_token_ids and tok in cfg.stop_token_ids:
                return "stop"
            if cfg.stop_words and state.text is not None:
                for word in cfg.stop_words:
                    at = state.text.find(word, max(0, scan_from - len(word) + 1))
                    if at >= 0:
                        state.text = state.text[:at]
                        return "stop"
        if num_generated >= cfg.max_new_tokens or seq.num_tokens + pending + 1 >= self.session_len:
            return "length"
        return None
