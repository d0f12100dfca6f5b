"""What the HTTP layer adds to the engine: one `ServerSettings`, filled from the flags."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    """What the HTTP layer adds to the engine (each one a `lmengine serve` flag).

    Plain values read by the routes; it never holds the engine or any request state.
    """

    model_name: str  # the id clients put in `model`
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed
    max_queued_requests: int = 0  # choices waiting for their first token; 0: no limit
    request_timeout: float = 0.0  # seconds; 0: none
    # goodput: a finished request meets its objectives when its first token came within
    # slo_ttft_s and no gap between two of its tokens passed slo_itl_s (0: no objective)
    slo_ttft_s: float = 0.0
    slo_itl_s: float = 0.0
    chat_template: str | None = None  # Jinja source replacing the tokenizer's template
    tool_call_parser: str = "hermes"  # how tool calls are found in text (serve/tools.py)
    auto_tool_constraint: bool = True  # under tool_choice=auto, a call that starts parses
    qos_enabled: bool = False
    max_body_bytes: int = 4 << 20  # larger request bodies are answered 413; 0: no limit
    body_timeout: float = 30.0  # seconds from the headers to the body's end, else 408; 0: none
    enable_lora_updates: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_root: str | None = None  # a resolved folder: runtime loads only from inside it
    embedding_pooling: str = "last"  # /v1/embeddings: "last" token or "mean" over the input
