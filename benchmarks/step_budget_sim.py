"""The serving loads of `vllm bench serve`, replayed on lmengine's real Scheduler with steps
that cost what a cost function says, in simulated time: how each step budget trades first
tokens against the gaps between tokens, without a model, a server or an idle machine.

    python benchmarks/step_budget_sim.py                       # every budget, every load
    python benchmarks/step_budget_sim.py --cost 0.04 1.75e-3 2e-8 1e-3

`--cost` is the machine: seconds per step, per token, per query x key pair and per row, as
`StepCostModel.coefficients` reports them after a run (the default is an AMD EPYC Zen 3 core
pair in float32 on SmolLM2-135M). The loads are those of benchmarks/vllm_bench_serve.py: 64
prompts of 100 tokens, 128 new tokens each, Poisson 2 req/s (seed 0), 16 in flight, all at
once. "vllm" is vLLM's server schedule as its scheduler builds it (2,048 tokens a step,
decodes first and counted, prompt chunks cut exactly at the budget), on the same machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmengine.bench.report import nearest_rank  # noqa: E402
from lmengine.scheduler import BlockManager, Scheduler, get_policy  # noqa: E402
from lmengine.scheduler.budget import StepBudget  # noqa: E402
from lmengine.scheduler.sequence import Sequence  # noqa: E402
from lmengine.scheduler.step_cost import StepCostModel, step_features  # noqa: E402

ZEN3 = (0.040, 1.75e-3, 2e-8, 1.0e-3)
SPREAD = 0.002  # seconds between two of a burst's requests reaching the engine
LOADS = ("2 req/s", "16 concurrent", "all at once")


@dataclass
class Request:
    arrival: float
    times: list[float] = field(default_factory=list)


class VllmBudget(StepBudget):
    """vLLM's server budget: 2,048 tokens a step with the decodes counted in it, prompt
    chunks cut exactly where it ends."""

    def begin(self, running: list[Sequence]) -> None:
        super().begin(running)
        self.tokens_left -= sum(1 for s in running if s.num_uncomputed == 1)

    def chunk(self, start: int, num_new: int) -> int:
        return num_new if num_new <= 1 else max(0, min(num_new, self.tokens_left))


def warmed_up(seconds) -> StepCostModel:
    """A cost model that has seen a server's first minutes on this machine."""
    rng, model = random.Random(1), StepCostModel()
    for _ in range(100):
        chunks = [(rng.randint(100, 228), 1) for _ in range(rng.randint(0, 64))]
        chunks += [(0, rng.randint(2, 2048)) for _ in range(rng.randint(0, 2))]
        model.observe(chunks or [(100, 1)], seconds(chunks or [(100, 1)]))
    return model


def arrivals(load: str, num: int, seed: int = 0) -> list[float] | None:
    """Arrival times, or None for a closed loop of 16 in flight."""
    if load == "all at once":  # as the server takes them in: tokenized two at a time
        return [SPREAD * i for i in range(num)]
    if load == "2 req/s":
        rng, t, out = random.Random(seed), 0.0, []
        for _ in range(num):
            out.append(t)
            t += rng.expovariate(2.0)
        return out
    return None


def run(cost, load: str, budget: StepBudget, prompt: int = 100, new: int = 128, num: int = 64):
    """Replay `load` on a scheduler with `budget`; returns the per-request token times."""

    def seconds(chunks) -> float:
        return sum(c * x for c, x in zip(cost, step_features(chunks)))

    clock = [0.0]
    sched = Scheduler(BlockManager(8192, 0, 16), get_policy("fcfs"), 128, budget.max_tokens,
                      clock=lambda: clock[0])  # fmt: skip
    budget.cost = warmed_up(seconds)
    sched.budget = budget
    times = arrivals(load, num)
    pending = list(range(num))
    requests: dict[int, Request] = {}
    seqs: dict[int, Sequence] = {}

    def submit(i: int) -> None:
        requests[i] = Request(clock[0] if times is None else times[i])
        seq = Sequence(i, i, list(range(1, prompt + 1)), SimpleNamespace(max_new_tokens=new))
        seq.arrival_time = requests[i].arrival
        seqs[i] = seq
        sched.add_sequence(seq)

    in_flight = 0
    while pending or sched.running or sched.waiting:
        if times is None:
            while pending and in_flight < 16:
                submit(pending.pop(0))
                in_flight += 1
        else:
            if not (sched.running or sched.waiting) and times[pending[0]] > clock[0]:
                clock[0] = times[pending[0]]
            while pending and times[pending[0]] <= clock[0]:
                submit(pending.pop(0))
        out = sched.schedule()
        step = seconds(out.chunks)
        clock[0] += step
        sampled, finished = {}, []
        for it in out.scheduled:
            if it.needs_sample:
                sampled[it.seq.seq_id] = 7
                requests[it.seq.seq_id].times.append(clock[0])
                if it.seq.num_generated_tokens + 1 >= new:
                    finished.append(it.seq)
        sched.update(out, sampled, finished)
        sched.observe_step(out, step)
        in_flight -= len(finished)
    return list(requests.values())


def summary(requests: list[Request]) -> dict[str, float]:
    ttft = [r.times[0] - r.arrival for r in requests]
    gaps = [b - a for r in requests for a, b in zip(r.times, r.times[1:])]
    span = max(r.times[-1] for r in requests) - min(r.arrival for r in requests)
    return {
        "tok/s": sum(len(r.times) for r in requests) / span,
        "TTFT p50": 1000 * statistics.median(ttft),
        "TTFT p99": 1000 * nearest_rank(ttft, 99),
        "ITL p50": 1000 * statistics.median(gaps),
        "ITL p99": 1000 * nearest_rank(gaps, 99),
        "max gap": 1000 * max(gaps),
    }


def budgets(args) -> dict[str, StepBudget]:
    out: dict[str, StepBudget] = {"vllm": VllmBudget(2048)}
    for tokens in args.tokens:
        out[f"{tokens} tokens"] = StepBudget(tokens)
    for ms in args.targets:
        out[f"{args.tokens[-1]} tokens, {ms:g} ms"] = StepBudget(args.tokens[-1], ms / 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--cost", type=float, nargs=4, default=ZEN3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--targets", type=float, nargs="*", default=[250, 500, 1000])
    parser.add_argument("--loads", nargs="*", default=LOADS)
    args = parser.parse_args()
    cols = ("tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "max gap")
    print("| load | budget | " + " | ".join(cols) + " |")
    print("| --- | --- |" + " ---: |" * len(cols))
    for load in args.loads:
        for name, budget in budgets(args).items():
            row = summary(run(args.cost, load, budget))
            print(f"| {load} | {name} | " + " | ".join(f"{row[c]:,.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
