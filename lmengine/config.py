"""User-facing configuration: `EngineConfig` and `GenerationConfig`.

Both are dataclasses validated in `__post_init__`; a bad value raises `ValueError` naming the
field, the value and what is allowed. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")
# GenerationConfig fields that hold Python objects (tensors, callables, schemas): no flag
PYTHON_ONLY_FIELDS = frozenset(
    {"output_hidden_states", "steering", "logits_processors", "structured_outputs", "pooling"}
)
# GenerationConfig.pooling: the prompt's embedding from the final norm's output at its last
# token, or the mean over its tokens
POOLING_TYPES = ("last", "mean")
# GenerationConfig.structured_outputs: exactly one of these keys (vLLM's StructuredOutputsParams)
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
DEVICES = ("auto", "cuda", "cpu")
EVICTION_TYPES = ("recompute", "swap")
QUANT_POLICIES = (None, "w8a8", "gguf", "float")
KV_CACHE_DTYPES = ("auto", "int8")
SPECULATIVE_METHODS = ("ngram", "draft_model")
# GenerationConfig.early_stopping as the CLI spells it
_EARLY_STOP: dict[str, bool | str] = {"true": True, "false": False, "never": "never"}


def _check_range(name: str, value, low=None, high=None, *, low_open: bool = False) -> None:
    """Raise ValueError unless `low <= value <= high` (or `low < value` when `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN passes every comparison below
        raise ValueError(f"{name} must be a number, got nan")
    if low is not None and (value <= low if low_open else value < low):
        op = ">" if low_open else ">="
        raise ValueError(f"{name} must be {op} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass
class SteeringVector:
    """A steering vector: `scale * vector` is added to a layer's output at every position
    from `start` on (0: the whole prompt too). `vector` is a 1-D float tensor of the model's
    hidden size (checked by the engine)."""

    vector: object  # torch.Tensor [hidden_size]
    scale: float = 1.0
    start: int = 0  # first position steered

    def __post_init__(self) -> None:
        if not hasattr(self.vector, "shape") or not hasattr(self.vector, "dtype"):
            raise ValueError(
                f"a steering vector must be a tensor, got {type(self.vector).__name__}"
            )
        _check_range("steering scale", self.scale)
        _check_int("steering start", self.start, 0)


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a cheap proposer drafts up to `num_speculative_tokens` tokens per
    decoding sequence, and the model checks them all in one forward (see engine/speculative.py).

    `method="ngram"` drafts by prompt lookup: the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`). `method="draft_model"` runs `draft_model`, a smaller checkpoint with
    the same vocabulary (the target's own path works too), over its own paged KV cache.
    """

    method: str = "ngram"  # "ngram" (prompt lookup, no extra model) or "draft_model"
    num_speculative_tokens: int = 4  # tokens drafted per sequence per step
    draft_model: str | None = None  # folder of the draft checkpoint (method "draft_model")
    prompt_lookup_min: int = 1  # shortest n-gram matched (method "ngram")
    prompt_lookup_max: int = 3  # longest n-gram matched (method "ngram")

    def __post_init__(self) -> None:
        _check_choice("speculative.method", self.method, SPECULATIVE_METHODS)
        _check_int("speculative.num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("speculative.prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("speculative.prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not isinstance(self.draft_model, str):
            raise ValueError(
                "speculative.draft_model must name the draft checkpoint when method is "
                f"'draft_model', got {self.draft_model!r}"
            )

    @classmethod
    def parse(cls, value) -> SpeculativeConfig:
        """From a SpeculativeConfig, a dict of its fields, a JSON object, or a method name
        ("ngram"); anything else raises ValueError."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                import json

                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"speculative is not valid JSON: {e}") from None
            else:
                value = {"method": text}
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative must be a SpeculativeConfig, a dict or a JSON object, got {value!r}"
            )
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative has unknown fields {unknown}; known: {sorted(names)}")
        return cls(**value)


@dataclass
class EngineConfig:
    """How the engine is built: precision, device, KV cache size and the scheduler's budgets.

    `num_gpu_blocks == 0` sizes the device KV pool from `cache_max_entry_count` x free memory
    (on CPU: of available RAM). Blocks live on the chosen device even when it is the CPU.
    """

    # NOTE: "auto" on the CPU is float32 for GGUF-block models (float32 kernels); w8a8 models
    # take bfloat16 only where the CPU also has int8 units (AMX-INT8, VNNI)
    dtype: str = "auto"  # "auto": CPU bfloat16 with AMX/AVX512-BF16, else float32; CUDA half
    device: str = "auto"  # "auto": cuda when available, else cpu
    tp: int = 1  # tensor-parallel ranks
    block_size: int = 16  # tokens per KV block
    num_gpu_blocks: int = 0  # device KV blocks; 0 = derive from cache_max_entry_count
    num_cpu_blocks: int = 0  # host KV blocks for swap (0 = no swap space)
    cache_max_entry_count: float = 0.2  # fraction of free memory given to the KV pool
    max_batch_size: int = 128  # sequences per step
    max_prefill_token_num: int = 4096  # prompt tokens per step (up to 1/8 more to finish a prompt)
    # NOTE: prompt chunks fill what the step's predicted time (a cost model fitted to the
    # engine's own steps, scheduler/step_cost.py) leaves after its decodes
    max_step_ms: float = 0.0  # a step's latency target in ms; 0 = the token budget alone
    # NOTE: an idle engine's first step waits while a burst arrives (engine._gather_burst):
    # requests announced by a front door (Client.expect_arrival), and once two or more
    # wait, requests less than burst_gap_ms apart; a lone request never waits
    burst_wait_ms: float = 100.0  # the longest an idle engine waits for a burst's requests
    burst_gap_ms: float = 0.0  # arrivals this close are one burst; 0 = announced ones only
    session_len: int | None = None  # max prompt + generated tokens; None = model's limit
    eviction_type: str = "recompute"  # how to preempt when blocks run out
    scheduling_policy: str = "fcfs"
    priority_aging_s: float = 0.0  # seconds of waiting worth one priority level; 0 = no aging
    qos_config_path: str | None = None  # LMDeploy-QoS JSON: user groups and quotas
    adapters: dict[str, str] | None = None  # adapter name -> peft folder
    max_lora_slots: int = 8  # LoRA pool size, in adapters of max_lora_rank on every linear
    max_lora_rank: int = 0  # 0 = the largest rank among `adapters` (16 when there are none)
    # NOTE: the least recently used host copies beyond it are read again from their folder
    max_cpu_loras: int | None = None  # adapters kept in host memory; None = all
    # w8a8 on a float checkpoint: no smoothing; gguf: weight-only, float activations. None: a
    # GGUF file's blocks on CPU in float32 (docs/gguf.md), a model's own weights otherwise
    quant_policy: str | None = None  # "w8a8": int8 W+A; "gguf": GGUF blocks; "float": expand
    enable_prefix_caching: bool = False
    # NOTE: the server's default is True (vLLM's CPU pool is written at start too): a burst
    # meets a mapped pool instead of faulting fresh blocks in (docs/serving_latency.md)
    prefault_kv_cache: bool = False  # CPU: map the KV pool's memory at start, not at first use
    kv_cache_dtype: str = "auto"  # "auto": K/V in the model dtype; "int8": int8 + per-token scales
    # speculative decoding: a SpeculativeConfig, dict, JSON object or "ngram"; None = off
    speculative: SpeculativeConfig | str | None = None
    num_threads: int = 0  # CPU: torch intra-op threads; 0 = all cores
    trust_remote_code: bool = False
    # extra MODULE_MAP entries (HF qualified class name -> patched class), e.g. from user code
    module_map: dict[str, str] | None = None

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_int("tp", self.tp, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("num_gpu_blocks", self.num_gpu_blocks, 0)
        _check_int("num_cpu_blocks", self.num_cpu_blocks, 0)
        _check_range("cache_max_entry_count", self.cache_max_entry_count, 0, 1, low_open=True)
        _check_int("max_batch_size", self.max_batch_size, 1)
        _check_int("max_prefill_token_num", self.max_prefill_token_num, 1)
        _check_range("max_step_ms", self.max_step_ms, 0)
        _check_range("burst_wait_ms", self.burst_wait_ms, 0)
        _check_range("burst_gap_ms", self.burst_gap_ms, 0)
        if self.session_len is not None:
            _check_int("session_len", self.session_len, 1)
        _check_choice("eviction_type", self.eviction_type, EVICTION_TYPES)
        if not isinstance(self.scheduling_policy, str):
            raise ValueError(f"scheduling_policy must be a name, got {self.scheduling_policy!r}")
        _check_range("priority_aging_s", self.priority_aging_s, 0)
        if self.qos_config_path is not None and not isinstance(self.qos_config_path, str):
            raise ValueError(f"qos_config_path must be a path, got {self.qos_config_path!r}")
        _check_int("max_lora_slots", self.max_lora_slots, 1)
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, 1)
        _check_choice("quant_policy", self.quant_policy, QUANT_POLICIES)
        _check_int("num_threads", self.num_threads, 0)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.adapters is not None and not (
            isinstance(self.adapters, dict)
            and all(isinstance(k, str) and k for k in self.adapters)
            and all(isinstance(v, str) for v in self.adapters.values())
        ):
            raise ValueError(f"adapters must be a dict of name -> folder, got {self.adapters!r}")
        if self.module_map is not None and not (
            isinstance(self.module_map, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in self.module_map.items())
        ):
            raise ValueError(
                "module_map must be a dict of 'package.module.HFClass' -> "
                f"'package.module.PatchedClass' strings, got {self.module_map!r}"
            )
        _check_int("max_lora_rank", self.max_lora_rank, 0)
        if self.speculative is not None:
            self.speculative = SpeculativeConfig.parse(self.speculative)


@dataclass
class GenerationConfig:
    """How one request generates. Greedy when `do_sample` is False.

    `stop_words` are matched on the decoded text and the matched text is not returned.
    `logprobs=N` returns, for every generated token, its logprob and the top-N alternatives.

    Research fields (docs/research.md): `prompt_logprobs=N` scores the prompt (every prompt
    token after the first: its logprob and the top-N alternatives); `output_hidden_states`
    returns the residual stream after the chosen layers (0 = embeddings, i = after decoder
    layer i, as transformers' `output_hidden_states`; "all" for every one); `steering` adds
    a vector to chosen layers' outputs for this request's rows only; `logits_processors`
    are callables `(token_ids, logits_row) -> logits_row` run before sampling.
    `max_new_tokens=0` runs the prompt only (scoring, reading activations); with `pooling`
    ("last" or "mean") it also pools the final norm's output over the prompt into
    `Response.embedding` (not normalized: `Pipeline.embed` and the server normalize).
    """

    max_new_tokens: int = 512
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI: minus this from the logit of every generated token
    frequency_penalty: float = 0.0  # OpenAI: minus this times its count in the generated tokens
    no_repeat_ngram_size: int = 0
    stop_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    random_seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    num_beams: int = 1  # beam search width; 1 = greedy or sampling (see README: beam search)
    length_penalty: float = 1.0  # beam search: a finished beam scores logprob / length**this
    early_stopping: str | bool = False  # beam search: True, False or "never" (as transformers)
    num_return_sequences: int = 1  # beam search: best beams returned, <= num_beams
    # ---- research hooks (docs/research.md) --------------------------------------------------
    prompt_logprobs: int | None = None  # N: logprob of every prompt token + the top-N
    # score prompt tokens from this index on (earlier entries None; their positions may then
    # come from the prefix cache): a (context, continuation) pair scores its continuation
    prompt_logprobs_start: int = 0
    output_hidden_states: tuple[int, ...] | str | None = None  # layer indices, or "all"
    # layer index (>= 1) -> a [hidden_size] tensor, or a SteeringVector (scale, start position)
    steering: dict | None = None
    logits_processors: list | None = None  # callables (token_ids, logits_row) -> logits_row
    pooling: str | None = None  # "last" or "mean": Response.embedding (needs max_new_tokens=0)
    # constrained generation (docs/structured_outputs.md): exactly one of "json" (a JSON
    # schema, dict or string), "json_object" (True), "regex", "choice" (strings), "grammar"
    # (EBNF), "structural_tag" (xgrammar's structural tag: free text with constrained tags)
    structured_outputs: dict | None = None

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        _check_int("min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool, got {self.do_sample!r}")
        _check_range("temperature", self.temperature, 0, low_open=True)
        _check_int("top_k", self.top_k, 0)
        _check_range("top_p", self.top_p, 0, 1, low_open=True)
        _check_range("repetition_penalty", self.repetition_penalty, 0, low_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, 0)
        if self.stop_words is not None:
            if isinstance(self.stop_words, str):
                self.stop_words = [self.stop_words]
            if not all(isinstance(w, str) and w for w in self.stop_words):
                raise ValueError(f"stop_words must be non-empty strings, got {self.stop_words!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, int):
                self.stop_token_ids = [self.stop_token_ids]
            for t in self.stop_token_ids:
                _check_int("stop_token_ids[]", t, 0)
        if self.random_seed is not None:
            _check_int("random_seed", self.random_seed, 0, 2**64 - 1)  # torch.Generator's range
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
            if self.logprobs > 20:
                raise ValueError(f"logprobs must be <= 20, got {self.logprobs!r}")
        self._check_research()
        self._check_structured_outputs()
        self._check_beam_search()

    def _check_structured_outputs(self) -> None:
        """The shape of `structured_outputs`; compiling it is the engine's (xgrammar)."""
        spec = self.structured_outputs
        if spec is None:
            return
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if isinstance(spec, dict) and k in spec]
        if not isinstance(spec, dict) or len(kinds) != 1 or len(spec) != 1:
            kinds_text = ", ".join(STRUCTURED_OUTPUT_KINDS)
            raise ValueError(
                f"structured_outputs must be a dict with exactly one of {kinds_text}, "
                f"got {spec!r:.200}"
            )
        kind, value = kinds[0], spec[kinds[0]]
        ok = {
            "json": isinstance(value, (dict, str)),
            "json_object": value is True,
            "regex": isinstance(value, str) and bool(value),
            "choice": isinstance(value, (list, tuple))
            and bool(value)
            and all(isinstance(c, str) and c for c in value),
            "grammar": isinstance(value, str) and bool(value),
            "structural_tag": isinstance(value, (dict, str)) and bool(value),
        }[kind]
        if not ok:
            want = {
                "json": "a JSON schema (dict or string)",
                "json_object": "True",
                "regex": "a non-empty regex",
                "choice": "a non-empty list of non-empty strings",
                "grammar": "a non-empty EBNF grammar",
                "structural_tag": "an xgrammar structural tag (dict or JSON string)",
            }[kind]
            raise ValueError(f"structured_outputs[{kind!r}] must be {want}, got {value!r:.200}")
        if self.ignore_eos:
            raise ValueError(
                "structured_outputs with ignore_eos=True: the output ends where the grammar does"
            )
        if self.min_new_tokens:
            raise ValueError(
                f"structured_outputs with min_new_tokens={self.min_new_tokens}: the output ends "
                "where the grammar does"
            )

    def _check_research(self) -> None:
        """The shapes of the research fields; the model-dependent checks (layer range, vector
        size) are the engine's (`RequestValidator`)."""
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, 20)
        _check_int("prompt_logprobs_start", self.prompt_logprobs_start, 0)
        layers = self.output_hidden_states
        if layers is not None and layers != "all":
            if isinstance(layers, int) and not isinstance(layers, bool):
                layers = (layers,)
            if not isinstance(layers, (list, tuple)) or not layers:
                raise ValueError(
                    "output_hidden_states must be layer indices (a non-empty tuple of ints) or "
                    f"'all', got {self.output_hidden_states!r}"
                )
            for i in layers:
                _check_int("output_hidden_states[]", i, 0)
            self.output_hidden_states = tuple(sorted(set(layers)))
        if self.steering is not None:
            if not isinstance(self.steering, dict) or not self.steering:
                raise ValueError(
                    f"steering must be a non-empty dict of layer -> vector, got {self.steering!r}"
                )
            for layer, vector in self.steering.items():
                _check_int("steering layer", layer, 1)
                if not isinstance(vector, SteeringVector):
                    self.steering[layer] = SteeringVector(vector)
        if self.pooling is not None:
            if self.pooling not in POOLING_TYPES:
                raise ValueError(
                    f"pooling must be one of {', '.join(POOLING_TYPES)} or None, got "
                    f"{self.pooling!r}"
                )
            if self.max_new_tokens != 0:
                raise ValueError(
                    f"pooling={self.pooling!r} embeds the prompt: max_new_tokens must be 0, got "
                    f"{self.max_new_tokens}"
                )
        if self.logits_processors is not None:
            if callable(self.logits_processors):
                self.logits_processors = [self.logits_processors]
            if not isinstance(self.logits_processors, (list, tuple)) or not all(
                callable(p) for p in self.logits_processors
            ):
                raise ValueError(
                    "logits_processors must be a list of callables (token_ids, logits) -> "
                    f"logits, got {self.logits_processors!r}"
                )
            self.logits_processors = list(self.logits_processors)

    def _check_beam_search(self) -> None:
        _check_int("num_beams", self.num_beams, 1)
        # NOTE: bounded so length ** length_penalty stays finite for any session length
        _check_range("length_penalty", self.length_penalty, -20.0, 20.0)
        if isinstance(self.early_stopping, str) and self.early_stopping.lower() in _EARLY_STOP:
            self.early_stopping = _EARLY_STOP[self.early_stopping.lower()]  # CLI strings
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
        _check_int("num_return_sequences", self.num_return_sequences, 1)
        if self.num_return_sequences > self.num_beams:
            raise ValueError(
                f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams "
                f"({self.num_beams})"
            )
        if self.num_beams == 1:
            return
        unsupported = {
            "do_sample": self.do_sample,
            "stop_words": bool(self.stop_words),
            "logprobs": self.logprobs is not None,
            "max_new_tokens": self.max_new_tokens == 0,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "output_hidden_states": self.output_hidden_states is not None,
            "steering": self.steering is not None,
            "logits_processors": self.logits_processors is not None,
            "structured_outputs": self.structured_outputs is not None,
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(
                    f"num_beams={self.num_beams}: beam search does not support {name}="
                    f"{getattr(self, name)!r} (use num_beams=1 for it)"
                )
