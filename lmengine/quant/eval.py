"""Perplexity through an Engine's patched model: the quality check of a quantized checkpoint.

The text is cut into windows of `window` tokens, each scored as its own sequence from position
0 and all of them run as one packed prefill through the ModelAgent's model (paged attention, the
w8a8 modules if any): exactly the code that serves requests.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from lmengine.engine.step import SeqInput, StepInput
from lmengine.models.context import step_context


def perplexity(engine, token_ids: list[int], window: int = 128, max_windows: int = 8) -> float:
    """exp(mean next-token NLL) over up to `max_windows` windows of `window` tokens.

    Runs on the engine's loop thread between steps and needs an idle engine: it writes KV into
    blocks 0.. without allocating them (NOTE: safe only while no sequence holds a block).
    """
    num_windows = min(max_windows, len(token_ids) // window)
    if num_windows < 1:
        raise ValueError(f"need at least {window} tokens, got {len(token_ids)}")
    windows = [token_ids[i * window : (i + 1) * window] for i in range(num_windows)]

    def run() -> float:
        stats = engine.scheduler.stats()
        if stats["num_free_blocks"] != stats["num_total_blocks"]:
            raise RuntimeError("perplexity needs an idle engine: some KV blocks are in use")
        agent = engine.model_agent
        bs = agent.cache_engine.spec.block_size
        blocks_per_window = math.ceil(window / bs)
        if blocks_per_window * num_windows > agent.num_gpu_blocks:
            raise ValueError(
                f"{num_windows} windows of {window} tokens need "
                f"{blocks_per_window * num_windows} KV blocks; the engine has "
                f"{agent.num_gpu_blocks}"
            )
        seqs = [
            SeqInput(i, 0, w, list(range(i * blocks_per_window, (i + 1) * blocks_per_window)), True)
            for i, w in enumerate(windows)
        ]
        input_ids, ctx = agent.runner.prepare(StepInput(seqs))
        ctx.logits_indices = torch.arange(input_ids.shape[0], device=input_ids.device)
        with torch.inference_mode(), step_context(ctx):
            logits = agent.model(input_ids).float()  # [num_windows * window, vocab]
        logits = logits.view(num_windows, window, -1)[:, :-1]  # predict tokens 1..window-1
        targets = input_ids.view(num_windows, window)[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return math.exp(nll.item())

    return engine.call(run, timeout=None)


HELDOUT_TEXT_PATH = Path(__file__).parent / "data" / "heldout.txt"


def heldout_token_ids(tokenizer) -> list[int]:
    """The committed held-out paragraphs (never used for calibration), tokenized."""
    text = HELDOUT_TEXT_PATH.read_text(encoding="utf-8")
    return tokenizer(text, add_special_tokens=False)["input_ids"]
