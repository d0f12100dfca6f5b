"""Scheduling policies and QoS on lmengine, measured: the vLLM policy study's table and more.

    python benchmarks/policies.py                  # everything, 3 runs per cell
    python benchmarks/policies.py --quick          # a smoke test: fewer, shorter requests, 1 run
    python benchmarks/policies.py --parts table    # only the policy table (also: hetero, qos)

Parts:
- table: four scenarios (dense/sparse Poisson arrivals x short/long requests, lengths drawn
  uniformly within +-50 % of 20 and 80 tokens, prompt and output alike) x five policies,
  `--runs` runs each: total time, throughput (req/s), mean and p99 latency, mean TTFT. Arrival
  rates are scaled to this machine: a calibration burst measures the engine's service rate mu
  (req/s) per length; dense arrives at 2 mu, sparse at 0.4 mu.
- hetero: a dense mix of short (8-16 new tokens) and long (120-160) requests, where the
  policies really differ.
- qos: LMDeploy-QoS groups (Platinum vip; Gold a 75 % / b 25 %; Bronze everyone else) under
  closed-loop backlogged Gold and Bronze clients and sparse Platinum arrivals: per-group p50/p99
  TTFT and per-user token shares over time against the quotas (PNG in docs/). Then three
  equal-quota backlogged users: Jain's fairness index and the largest service gap between two
  of them, against VTC's bound (2 x the largest request's tokens).

One Engine (the default model, float32, CPU) serves every run; the policy is switched between
runs on the engine thread. `max_batch_size` is small (default 4) so that requests queue and the
policy matters, as on a saturated server. Results go to stdout (markdown) and `--json`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.bench.report import nearest_rank
from lmengine.scheduler import get_policy
from lmengine.scheduler.qos import QoS, QoSConfig

POLICIES = ("fcfs", "priority", "sjf", "ldf", "lcfs")
DOCS = Path(__file__).resolve().parent.parent / "docs"
QOS_CONFIG = {
    "enable_user_qos": True,
    "user_groups": ["Platinum", "Gold", "Bronze"],
    "user_group_map": {
        "Platinum": [{"id": "vip", "quota_pct": 100}],
        "Gold": [{"id": "a", "quota_pct": 75}, {"id": "b", "quota_pct": 25}],
        "Bronze": [{"id": "default", "quota_pct": 100}],
    },
}
FAIR_CONFIG = {
    "enable_user_qos": True,
    "user_groups": ["Gold"],
    "user_group_map": {"Gold": [{"id": u, "quota_pct": 1} for u in ("x", "y", "z")]},
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tiny_llama() -> str:
    """A tiny random Llama (2 layers, hidden 64, SmolLM2's tokenizer) in a temporary folder:
    scheduling in steps and tokens behaves as with a real model, each step just costs less."""
    import tempfile

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lmengine.engine.loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="lmengine_tiny_")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        cfg = EngineConfig(
            max_batch_size=args.max_batch_size,
            eviction_type="swap",
            num_cpu_blocks=args.num_cpu_blocks,
            num_threads=args.num_threads,
        )
        model = tiny_llama() if args.tiny else args.model
        self.engine = Engine.from_pretrained(model, cfg)
        self.vocab = self.engine.info.vocab_size
        self.results: dict = {"config": vars(args)}

    def close(self) -> None:
        self.engine.close()

    # ---- running a workload --------------------------------------------------------------------
    def set_scheduling(self, policy: str, qos_config: dict | None = None) -> None:
        def apply():
            sched = self.engine.scheduler
            sched.policy = get_policy(policy)
            sched.qos = QoS(QoSConfig.from_dict(qos_config)) if qos_config else None

        self.engine.call(apply)

    def request(self, prompt_len: int, new: int) -> tuple[list[int], GenerationConfig]:
        ids = [self.rng.randrange(3, self.vocab) for _ in range(prompt_len)]
        return ids, GenerationConfig(max_new_tokens=new, ignore_eos=True)

    def run(self, reqs: list[dict]) -> list[dict]:
        """Submit each request at its `at` (seconds from start) from its own thread; returns
        per-request submit, first-token and finish times (seconds from start)."""
        t0 = time.perf_counter()
        out: list[dict] = [{} for _ in reqs]

        def work(i: int, r: dict) -> None:
            time.sleep(max(0.0, r["at"] - (time.perf_counter() - t0)))
            rec = out[i]
            rec["submit"] = time.perf_counter() - t0
            inst = self.engine.create_instance()
            for resp in inst.stream_infer(
                r["session_id"],
                r["ids"],
                r["gen"],
                priority=r.get("priority"),
                user_id=r.get("user"),
            ):
                if "first" not in rec and resp.token_ids:
                    rec["first"] = time.perf_counter() - t0
                if resp.finish_reason is not None:
                    rec["done"] = time.perf_counter() - t0
                    if resp.finish_reason != "length":
                        raise RuntimeError(f"request failed: {resp.finish_reason} {resp.error}")

        threads = [threading.Thread(target=work, args=(i, r)) for i, r in enumerate(reqs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return out

    def make_reqs(self, n: int, rate: float, lengths) -> list[dict]:
        """`n` requests with Poisson arrivals at `rate` req/s; `lengths()` -> (prompt, new)."""
        t, reqs = 0.0, []
        for i in range(n):
            prompt_len, new = lengths()
            ids, gen = self.request(prompt_len, new)
            reqs.append(dict(at=t, ids=ids, gen=gen, priority=self.rng.randint(0, 3), session_id=i))
            t += self.rng.expovariate(rate) if rate > 0 else 0.0
        return reqs

    @staticmethod
    def metrics(recs: list[dict]) -> dict:
        start = min(r["submit"] for r in recs)
        total = max(r["done"] for r in recs) - start
        lat = [r["done"] - r["submit"] for r in recs]
        ttft = [r["first"] - r["submit"] for r in recs]
        return {
            "total_s": total,
            "req_per_s": len(recs) / total,
            "mean_latency_s": statistics.mean(lat),
            "p99_latency_s": nearest_rank(lat, 99),
            "mean_ttft_s": statistics.mean(ttft),
        }

    # ---- the vLLM policy table + heterogeneous -------------------------------------------------
    def around(self, center: int):
        lo, hi = max(1, center // 2), center * 3 // 2
        return lambda: (self.rng.randint(lo, hi), self.rng.randint(lo, hi))

    def calibrate(self, center: int) -> float:
        """Service rate (req/s) of a burst of requests of this length, FCFS."""
        self.set_scheduling("fcfs")
        n = max(4, self.args.num_requests // 2)
        recs = self.run(self.make_reqs(n, 0.0, self.around(center)))
        return self.metrics(recs)["req_per_s"]

    def cell(self, policy: str, make) -> dict:
        runs = []
        for k in range(self.args.runs):
            self.rng.seed(self.args.seed * 1000 + k)  # the same requests for every policy
            reqs = make()
            self.set_scheduling(policy)
            runs.append(self.metrics(self.run(reqs)))
        return {key: statistics.mean(r[key] for r in runs) for key in runs[0]}

    def table(self) -> None:
        rows = {}
        for name, center in (("short", 20), ("long", 80)):
            mu = self.calibrate(center)
            log(f"service rate, {name} requests: {mu:.2f} req/s")
            self.results.setdefault("service_rate_req_per_s", {})[name] = mu
            for density, factor in (("dense", 2.0), ("sparse", 0.4)):
                scenario = f"{density} {name}"
                for policy in POLICIES:
                    log(f"{scenario}: {policy}")
                    n = self.args.num_requests

                    def make(rate=factor * mu, c=center, n=n):
                        return self.make_reqs(n, rate, self.around(c))

                    rows[(scenario, policy)] = self.cell(policy, make)
        self.results["table"] = {f"{s} / {p}": v for (s, p), v in rows.items()}

    def hetero(self) -> None:
        short_n, long_n = (8, 16), (120, 160)
        if self.args.quick:
            short_n, long_n = (4, 8), (40, 60)

        def lengths():
            new = self.rng.randint(*(long_n if self.rng.random() < 0.3 else short_n))
            return self.rng.randint(10, 30), new

        rows = {}
        for policy in POLICIES:
            log(f"heterogeneous: {policy}")
            rows[policy] = self.cell(
                policy, lambda: self.make_reqs(self.args.num_requests, 0.0, lengths)
            )
        self.results["hetero"] = rows

    # ---- QoS ----------------------------------------------------------------------------------
    def closed_loop(self, users: dict[str, int], duration: float, vip_rate: float, size):
        """Clients that keep `users[u]` requests in flight for `duration` seconds, plus Poisson
        'vip' arrivals; samples every step's cumulative served tokens per tenant."""
        samples: list[tuple[float, dict[str, int]]] = []
        eng = self.engine
        t0 = time.perf_counter()
        added_at: dict[int, int] = {}  # request id -> steps started before it was queued
        first_at: dict[int, int] = {}  # request id -> the step that sampled its first token

        def observe(report) -> None:
            # NOTE: on the loop thread, so steps count exactly (a client thread may wake up
            # steps after its token was published)
            for request_id in report.added:
                added_at[request_id] = report.step - 1
            for work in report.scheduled:
                if work.needs_sample and work.num_generated_tokens == 1:
                    first_at.setdefault(work.request_id, report.step)
            users = report.counters["qos"]["users"]
            samples.append(
                (time.perf_counter() - t0, {u: v["num_served_tokens"] for u, v in users.items()})
            )

        eng.add_observer(observe)
        ttfts: dict[str, list[float]] = {}
        max_tokens = [0]
        lock = threading.Lock()
        ids_counter = iter(range(10**9))

        def one(user: str) -> None:
            with lock:
                prompt_len, new = size()
                ids, gen = self.request(prompt_len, new)
                sid = next(ids_counter)
                max_tokens[0] = max(max_tokens[0], prompt_len + new)
            submit = time.perf_counter()
            first = None
            inst = eng.create_instance()
            for resp in inst.stream_infer(sid, ids, gen, user_id=user):
                if first is None and resp.token_ids:
                    first = time.perf_counter() - submit
            # steps from queueing to the first token: 1 = admitted by the very next step
            with lock:
                ttfts.setdefault(user, []).append((first, first_at[sid] - added_at[sid]))

        def client(user: str) -> None:
            while time.perf_counter() - t0 < duration:
                one(user)

        def vip() -> None:
            while True:
                time.sleep(self.rng.expovariate(vip_rate))
                if time.perf_counter() - t0 >= duration:
                    return
                one("vip")

        threads = [
            threading.Thread(target=client, args=(u,)) for u, k in users.items() for _ in range(k)
        ]
        if vip_rate:
            threads.append(threading.Thread(target=vip))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        eng.remove_observer(observe)
        return samples, ttfts, max_tokens[0]

    def qos(self) -> None:
        a = self.args
        size = lambda: (self.rng.randint(8, 24), self.rng.randint(8, 24))  # noqa: E731
        self.set_scheduling("fcfs", QOS_CONFIG)
        # NOTE: more clients than batch slots, so that both Gold users always have requests
        # waiting (backlogged); Bronze only gets what Gold leaves
        users = {"a": 6, "b": 6, "bronze1": 2, "bronze2": 2}
        samples, ttfts, _ = self.closed_loop(users, a.qos_seconds, a.vip_rate, size)
        group_of = {"vip": "Platinum", "a": "Gold", "b": "Gold"}
        by_group: dict[str, list[float]] = {}
        for user, values in ttfts.items():
            by_group.setdefault(group_of.get(user, "Bronze"), []).extend(values)
        ttft = {
            g: {
                "n": len(v),
                "p50_s": nearest_rank([x[0] for x in v], 50),
                "p99_s": nearest_rank([x[0] for x in v], 99),
                "p50_steps": nearest_rank([x[1] for x in v], 50),
                "max_steps": max(x[1] for x in v),
            }
            for g, v in by_group.items()
        }
        share_a = self._share_series(samples, "a", "b")
        # NOTE: shares count while the users are backlogged, i.e. until the clients stop
        # submitting; what is left in the queues afterwards drains in any order
        final = self._at(samples, a.qos_seconds)
        total_ab = final.get("a", 0) + final.get("b", 0)
        self.results["qos"] = {
            "ttft_by_group": ttft,
            "gold_share_a": final.get("a", 0) / total_ab if total_ab else None,
            "gold_quota_a": 0.75,
            "served_tokens": final,
        }
        # fairness: three equal-quota backlogged users
        self.set_scheduling("fcfs", FAIR_CONFIG)
        fair_samples, _, max_tok = self.closed_loop(
            {"x": 4, "y": 4, "z": 4}, a.qos_seconds / 2, 0.0, size
        )
        self.set_scheduling("fcfs")
        fair_samples = [x for x in fair_samples if x[0] <= a.qos_seconds / 2]
        totals = fair_samples[-1][1]
        xs = [totals.get(u, 0) for u in ("x", "y", "z")]
        jain = sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else None
        gap = 0
        for u, v in (("x", "y"), ("x", "z"), ("y", "z")):
            diffs = [s.get(u, 0) - s.get(v, 0) for _, s in fair_samples]
            gap = max(gap, max(diffs) - min(diffs))
        self.results["fairness"] = {
            "served_tokens": dict(zip("xyz", xs)),
            "jain_index": jain,
            "max_service_gap_tokens": gap,
            "vtc_bound_tokens": 2 * max_tok,
        }
        stop_step = sum(1 for t, _ in samples if t <= a.qos_seconds)
        self._plot(share_a, stop_step, fair_samples)

    @staticmethod
    def _at(samples, t: float) -> dict[str, int]:
        """Cumulative served tokens per user at time t (the last sample before it)."""
        last = samples[0][1]
        for when, s in samples:
            if when > t:
                break
            last = s
        return last

    @staticmethod
    def _share_series(samples, u: str, v: str, window: int = 40):
        """(step, share of u in the tokens served to u and v over the last `window` steps)."""
        series = []
        for i in range(window, len(samples)):
            now, then = samples[i][1], samples[i - window][1]
            du, dv = now.get(u, 0) - then.get(u, 0), now.get(v, 0) - then.get(v, 0)
            if du + dv > 0:
                series.append((i, du / (du + dv)))
        return series

    def _plot(self, share_a, stop_step: int, fair_samples) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        ax = axes[0]
        if share_a:
            t, s = zip(*share_a)
            ax.plot(t, s, label="user a (quota 75 %)")
            ax.plot(t, [1 - x for x in s], label="user b (quota 25 %)")
        ax.axhline(0.75, ls="--", c="gray")
        ax.axhline(0.25, ls="--", c="gray")
        ax.axvline(stop_step, ls=":", c="k", label="clients stop (backlog drains)")
        ax.set(
            title="Gold group: share of served tokens (last 40 steps)",
            xlabel="engine step",
            ylabel="share",
            ylim=(0, 1),
        )
        ax.legend()
        ax = axes[1]
        for u in ("x", "y", "z"):
            ax.plot([t for t, _ in fair_samples], [s.get(u, 0) for _, s in fair_samples], label=u)
        ax.set(title="equal quotas: cumulative served tokens", xlabel="time (s)", ylabel="tokens")
        ax.legend()
        fig.tight_layout()
        path = Path(self.args.plot)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
        log(f"plot written to {path}")

    # ---- report -------------------------------------------------------------------------------
    def report(self) -> str:
        lines = []
        cols = ("total_s", "req_per_s", "mean_latency_s", "p99_latency_s", "mean_ttft_s")
        header = "| scenario | policy | total s | req/s | mean lat s | p99 lat s | mean TTFT s |"
        sep = "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
        if "table" in self.results:
            lines += [f"service rate (req/s): {self.results['service_rate_req_per_s']}", ""]
            lines += [header, sep]
            for key, m in self.results["table"].items():
                scenario, policy = key.split(" / ")
                vals = " | ".join(f"{m[c]:.2f}" for c in cols)
                lines.append(f"| {scenario} | {policy} | {vals} |")
            lines.append("")
        if "hetero" in self.results:
            lines += [header, sep]
            for policy, m in self.results["hetero"].items():
                vals = " | ".join(f"{m[c]:.2f}" for c in cols)
                lines.append(f"| heterogeneous | {policy} | {vals} |")
            lines.append("")
        if "qos" in self.results:
            q = self.results["qos"]
            lines += [
                "| group | requests | p50 TTFT s | p99 TTFT s | p50 TTFT steps | max TTFT steps |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            for g in ("Platinum", "Gold", "Bronze"):
                if g in q["ttft_by_group"]:
                    v = q["ttft_by_group"][g]
                    lines.append(
                        f"| {g} | {v['n']} | {v['p50_s']:.2f} | {v['p99_s']:.2f} "
                        f"| {v['p50_steps']} | {v['max_steps']} |"
                    )
            share = q["gold_share_a"]
            lines.append("")
            lines.append(
                f"Gold share of user a: {share:.3f} (quota 0.75, error {abs(share - 0.75):.3f})"
                if share is not None
                else "Gold share: nothing served"
            )
            f = self.results["fairness"]
            lines.append(
                f"equal quotas x/y/z: served {f['served_tokens']}, Jain's index "
                f"{f['jain_index']:.4f}, max service gap {f['max_service_gap_tokens']} tokens "
                f"(VTC bound {f['vtc_bound_tokens']})"
            )
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="benchmarks/policies.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument("--model", default=None, help="model folder or hub id (default: SmolLM2)")
    p.add_argument("--parts", default="table,hetero,qos", help="comma list: table,hetero,qos")
    p.add_argument("--runs", type=int, default=3, help="runs per table cell")
    p.add_argument("--num-requests", type=int, default=12, help="requests per run")
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--num-cpu-blocks", type=int, default=256)
    p.add_argument("--qos-seconds", type=float, default=60.0, help="length of the QoS run")
    p.add_argument("--vip-rate", type=float, default=0.3, help="Platinum arrivals per second")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random Llama instead of the model: same scheduling, cheaper steps",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-threads", type=int, default=0, help="torch threads (0: all cores; 1 on a busy box)"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: small sizes, one run")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--plot", default=str(DOCS / "qos_shares.png"))
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.num_requests, args.qos_seconds = 1, 6, 16.0
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in ("table", "hetero", "qos")]
    if bad:
        p.error(f"unknown parts {bad}")
    bench = Bench(args)
    try:
        for part in parts:
            getattr(bench, part)()
    finally:
        bench.close()
    print(bench.report())
    if args.json:
        Path(args.json).write_text(json.dumps(bench.results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
