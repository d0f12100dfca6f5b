"""How much of a prompt one step computes, within the step's prefill budget."""

from __future__ import annotations

# NOTE: a prompt's first token comes with the step that computes its last chunk. Cutting a step
# exactly at the budget leaves the prompt that straddles it a short tail, and its first token a
# whole step later, to save a few percent of this step. A burst of 64 prompts of 100 tokens at
# 1,024 tokens a step finished ten prompts per step instead of eleven, and its median first
# token (vllm bench serve, all at once) came a step later (docs/serving_latency.md). Steps may
# run over the budget by this share of it instead.
PREFILL_SLACK = 1 / 8


def prefill_chunk(num_new: int, left: int, budget: int) -> int:
    """Prompt tokens to compute this step for a sequence with `num_new` not computed yet, when
    `left` of the step's `budget` remain: all of them if they overrun `left` by at most the
    slack, else as many as are left (0 when none)."""
    if left > 0 and num_new <= left + int(budget * PREFILL_SLACK):
        return num_new
    return max(0, min(num_new, left))
