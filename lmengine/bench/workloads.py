"""The workloads: what W1 (offline batch), W2 (single stream) and W3 (prefill) run on each
system, and the rows their measurements fill."""

from __future__ import annotations

import argparse
import time

from lmengine.bench.flags import WORKLOADS, Sizes
from lmengine.bench.measure import System, measure_interleaved
from lmengine.bench.results import HF_CB, HF_STATIC, LM, BenchError, Row
from lmengine.bench.systems import Systems


class Bench(Systems):
    """The systems plus what was measured on them: one method per workload fills `rows` and
    describes the workload in `workload_desc`. It never formats the report (`report` does)."""

    def __init__(self, args: argparse.Namespace) -> None:
        sizes = Sizes.from_args(args)
        self.repeat: int = args.repeat
        super().__init__(args, sizes)
        self.rows: list[Row] = []
        self.workload_desc: dict[str, str] = {}  # "W1" -> what it ran
        self._pending_cb: tuple | None = None

    def _measure(self, systems: list[System]) -> None:
        self.rows.extend(measure_interleaved(systems, self.repeat))

    # ---- W1 -----------------------------------------------------------------------------------
    def w1(self) -> None:
        s = self.sizes
        ids, new = self.prompts.w1, s.max_new_tokens
        total = len(ids) * new
        warm_ids, warm_new = ids[: min(4, len(ids))], min(8, new)
        title = "W1"
        self.workload_desc[title] = (
            f"offline batch: {len(ids)} chat prompts ({min(map(len, ids))}-{max(map(len, ids))} "
            f"tokens) submitted at once, {new} new tokens each, EOS ignored; output tok/s"
        )

        row = Row(title, LM, "output tok/s")
        hf_row = Row(title, HF_STATIC, "output tok/s", note="generate, left-padded batch")
        self._measure(
            [
                (
                    [row],
                    lambda: self.lm_batch(warm_ids, warm_new),
                    lambda: [total / self.lm_batch(ids, new)],
                ),
                (
                    [hf_row],
                    lambda: self.hf_generate(warm_ids, warm_new),
                    lambda: [total / self.hf_generate(ids, new)],
                ),
            ]
        )
        try:
            row.note = f"preemptions={self.engine.stats()['num_preemptions']}"
        except Exception as e:  # the engine may be dead after a failure
            row.note = f"stats unavailable: {e!r}"
        if not self.args.skip_hf_batch:  # run last: see `transformers_cb`
            self._pending_cb = (title, ids, new, warm_ids, warm_new)

    def transformers_cb(self) -> None:
        """W1 through transformers' `generate_batch`, after every other measurement: its
        thread runs torch ops, and while a thread that owns an OpenMP pool lives, libgomp
        (more pool threads than cores) stops spin-waiting, which made lmengine's single-stream
        decode ~30 % slower in this process."""
        pending = self._pending_cb
        if pending is not None:
            self._pending_cb = None
            self._w1_hf_cb(*pending)
            order = {w.upper(): i for i, w in enumerate(WORKLOADS)}
            self.rows.sort(key=lambda row: order.get(row.workload, len(order)))

    def _w1_hf_cb(
        self, title: str, ids: list[list[int]], new: int, warm_ids: list[list[int]], warm_new: int
    ) -> None:
        cb_config, note = self.hf_cb_config(ids, new)
        row = Row(title, HF_CB, "output tok/s", note=note)
        t0 = time.perf_counter()
        try:
            self._measure(
                [
                    (
                        [row],
                        lambda: self.hf_cb_generate(warm_ids, warm_new, cb_config),
                        lambda: [len(ids) * new / self.hf_cb_generate(ids, new, cb_config)],
                    )
                ]
            )
        finally:
            self.hf_cb_close()
        self.setup["transformers_cb_wall_s"] = round(time.perf_counter() - t0, 2)

    # ---- W2 -----------------------------------------------------------------------------------
    def w2(self) -> None:
        ids, new = self.prompts.w2, self.sizes.w2_new_tokens
        title = "W2"
        self.workload_desc[title] = (
            f"single stream: one {len(ids)}-token chat prompt, {new} new tokens; "
            "TTFT and decode tok/s = (n-1) / (t_last - t_first)"
        )

        lm_rows = [
            Row(title, LM, "TTFT ms", higher_is_better=False, note="EngineInstance.stream_infer"),
            Row(title, LM, "decode tok/s", note="EngineInstance.stream_infer"),
        ]

        def hf_run() -> list[float]:
            ttft = self.hf_generate([ids], 1)
            full = self.hf_generate([ids], new)
            if full <= ttft:
                raise BenchError(f"generate({new}) took {full:.3f} s <= generate(1) {ttft:.3f} s")
            return [ttft * 1000, (new - 1) / (full - ttft)]

        hf_rows = [
            Row(title, HF_STATIC, "TTFT ms", higher_is_better=False, note="generate(1)"),
            Row(title, HF_STATIC, "decode tok/s", note="(N-1) / (t generate(N) - t generate(1))"),
        ]
        self._measure(
            [
                (lm_rows, lambda: self.lm_stream(ids, 4), lambda: self.lm_stream(ids, new)),
                (hf_rows, lambda: self.hf_generate([ids], 4), hf_run),
            ]
        )

    # ---- W3 -----------------------------------------------------------------------------------
    def w3(self) -> None:
        ids, new = self.prompts.w3, self.sizes.w3_new_tokens
        total = sum(len(x) for x in ids)
        lens = f"{min(map(len, ids))}-{max(map(len, ids))}"
        title = "W3"
        self.workload_desc[title] = (
            f"prefill: {len(ids)} chat prompts of {lens} tokens ({total} in all), {new} new "
            "tokens; prompt tok/s until every request has its first token"
        )
        warm = ids[: min(2, len(ids))]

        row = Row(title, LM, "prefill tok/s", note="Pipeline.stream_infer, first delta each")
        hf_row = Row(title, HF_STATIC, "prefill tok/s", note="generate(1), left-padded batch")
        self._measure(
            [
                (
                    [row],
                    lambda: self.lm_first_tokens(warm, 2),
                    lambda: [total / self.lm_first_tokens(ids, new)],
                ),
                (
                    [hf_row],
                    lambda: self.hf_generate(warm, 1),
                    lambda: [total / self.hf_generate(ids, 1)],
                ),
            ]
        )
