"""The flags of `lmengine bench` (shared with `benchmarks/throughput.py`) and the workload sizes
they resolve to."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("w1", "w2", "w3")
# examples/prompts.txt of the repository links here: the package carries its own copy
DEFAULT_PROMPT_FILE = Path(__file__).resolve().parents[1] / "data" / "prompts.txt"

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
_SIZE_HELPS = {
    "num_prompts": "W1 prompts (cycling through the prompt file)",
    "max_new_tokens": "W1 new tokens per prompt",
    "w2_prompt_tokens": "W2 prompt length in tokens (at least)",
    "w2_new_tokens": "W2 new tokens",
    "w3_num_prompts": "W3 number of long prompts",
    "w3_prompt_tokens": "W3 tokens per prompt (at least)",
    "w3_new_tokens": "W3 new tokens per prompt",
}


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
    for name, (full, _) in _SIZES.items():
        sizes.add_argument(
            "--" + name.replace("_", "-"),
            type=_positive_int,
            default=None,
            help=f"{_SIZE_HELPS[name]} (default: {full})",
        )
    _add_engine_flags(p)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig knobs the benchmark exposes (None: the EngineConfig default)."""
    from lmengine.config import EngineConfig

    d = EngineConfig()
    eng = parser.add_argument_group("lmengine engine knobs (EngineConfig)")
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


@dataclass
class Sizes:
    """The resolved size of every workload: an explicit flag, else the --quick or the full
    default. Numbers only; the prompts of those sizes are built by `bench.prompts`."""

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
