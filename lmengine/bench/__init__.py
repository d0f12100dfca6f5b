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

The parts: `flags` (the flags and the workload sizes), `prompts` (the token ids each workload
runs), `systems` (lmengine and transformers, loaded once, one timed call at a time), `measure`
(warm-up and alternating timed runs), `results` (rows and ratios), `workloads` (W1, W2, W3),
`report` (the printed tables) and `run` (one whole run and its JSON).
"""

from __future__ import annotations

from lmengine.bench.flags import DEFAULT_PROMPT_FILE, WORKLOADS, Sizes, add_bench_flags
from lmengine.bench.results import HF_CB, HF_STATIC, LM, BenchError, Row
from lmengine.bench.run import run_benchmarks
from lmengine.bench.workloads import Bench

__all__ = [
    "DEFAULT_PROMPT_FILE",
    "HF_CB",
    "HF_STATIC",
    "LM",
    "WORKLOADS",
    "Bench",
    "BenchError",
    "Row",
    "Sizes",
    "add_bench_flags",
    "run_benchmarks",
]
