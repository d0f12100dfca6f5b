"""Perplexity through an Engine: the quality check of a quantized checkpoint.

The text is cut into windows of `window` tokens, each scored as its own request from position
0 (`Pipeline.score`: prompt logprobs, batched and paged like any request), so the check runs
exactly the code that serves requests: the w8a8 modules, the KV cache dtype, the kernels.
"""

from __future__ import annotations

import math
from pathlib import Path

from lmengine.api import Pipeline


def perplexity(engine, token_ids: list[int], window: int = 128, max_windows: int = 8) -> float:
    """exp(mean next-token NLL) over up to `max_windows` windows of `window` tokens."""
    num_windows = min(max_windows, len(token_ids) // window)
    if num_windows < 1:
        raise ValueError(f"need at least {window} tokens, got {len(token_ids)}")
    windows = [token_ids[i * window : (i + 1) * window] for i in range(num_windows)]
    scores = Pipeline(engine).score(windows)  # NOTE: the engine stays open (not closed here)
    failed = [s.error for s in scores if s.error is not None]
    if failed:
        raise ValueError(f"perplexity: a window could not be scored: {failed[0]}")
    logprobs = [lp for s in scores for lp in s.logprobs]
    return math.exp(-math.fsum(logprobs) / len(logprobs))


HELDOUT_TEXT_PATH = Path(__file__).parent / "data" / "heldout.txt"


def heldout_token_ids(tokenizer) -> list[int]:
    """The committed held-out paragraphs (never used for calibration), tokenized."""
    text = HELDOUT_TEXT_PATH.read_text(encoding="utf-8")
    return tokenizer(text, add_special_tokens=False)["input_ids"]
