"""What a step costs, in seconds, learned from the engine's own steps (Sarathi-Serve's
"stall-free batching" with a time budget instead of a fixed token count).

A step's time is modelled as linear in four features of its `SchedulerOutput`:

    seconds = c0 + c1 * tokens + c2 * attention + c3 * rows

- `tokens`: tokens computed (every linear layer's work, the bulk of a step);
- `attention`: query x key pairs, sum over the chunks of n * (start + (n + 1) / 2) (a chunk of
  n new tokens after `start` cached ones attends to on average start + (n + 1) / 2 keys);
- `rows`: sequences in the step (per-sequence work: sampling, metadata, the output stage);
- `c0`: the fixed cost of a step.

The coefficients are fitted online by recursive least squares with a forgetting factor, so
they follow the machine (another CPU, a neighbour taking cores) within tens of steps. The
model is trusted only once it has seen enough steps, prefills among them; until then it
predicts nothing and the Scheduler keeps to its token budget alone. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# features are scaled to similar magnitudes (tokens in thousands, query x key pairs in
# millions, rows in hundreds) so that the least-squares update stays well conditioned
SCALES = (1.0, 1e-3, 1e-6, 1e-2)
FORGET = 0.98  # the weight of a step 50 steps old is 1/e of the newest one's
MIN_STEPS = 8  # steps seen before the model is trusted
MIN_PREFILL_STEPS = 3  # of which with a prefill chunk (else prefill cost is unidentifiable)


def step_features(items) -> tuple[float, float, float, float]:
    """(1, tokens, attention, rows) of a step's scheduled (start_pos, num_new_tokens) pairs."""
    tokens = attention = 0.0
    rows = 0
    for start, n in items:
        tokens += n
        attention += n * (start + (n + 1) / 2)
        rows += 1
    return (1.0, tokens, attention, float(rows))


@dataclass
class StepCostModel:
    """Predicts a step's seconds from its chunks; learns from every step observed."""

    theta: list[float] = field(default_factory=lambda: [0.0] * 4)  # scaled coefficients
    cov: list[list[float]] = field(
        default_factory=lambda: [[1e4 if i == j else 0.0 for j in range(4)] for i in range(4)]
    )
    num_steps: int = 0
    num_prefill_steps: int = 0

    @property
    def ready(self) -> bool:
        return self.num_steps >= MIN_STEPS and self.num_prefill_steps >= MIN_PREFILL_STEPS

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(c0, c1, c2, c3) in seconds per unit of each feature, each at least 0 (a cost
        that fell below 0 by noise counts as free, never as a refund)."""
        c = [max(0.0, t * s) for t, s in zip(self.theta, SCALES)]
        return c[0], c[1], c[2], c[3]

    def predict(self, items) -> float:
        """Seconds for a step of these (start_pos, num_new_tokens) chunks."""
        return sum(c * x for c, x in zip(self.coefficients, step_features(items)))

    def observe(self, items, seconds: float) -> None:
        """Learn from one step of these (start_pos, num_new_tokens) chunks that took
        `seconds` (recursive least squares, forgetting old steps by FORGET)."""
        x = [f * s for f, s in zip(step_features(items), SCALES)]
        if x[3] == 0:
            return  # an empty step says nothing about costs
        p = self.cov
        px = [sum(p[i][j] * x[j] for j in range(4)) for i in range(4)]
        denom = FORGET + sum(x[i] * px[i] for i in range(4))
        gain = [v / denom for v in px]
        error = seconds - sum(t * v for t, v in zip(self.theta, x))
        self.theta = [t + g * error for t, g in zip(self.theta, gain)]
        self.cov = [[(p[i][j] - gain[i] * px[j]) / FORGET for j in range(4)] for i in range(4)]
        self.num_steps += 1
        if any(n > 1 for _, n in items):
            self.num_prefill_steps += 1

    def chunk_seconds(self, start: int, n: int) -> float:
        """What a chunk of `n` tokens after `start` cached ones adds to a step."""
        _, c1, c2, c3 = self.coefficients
        return c1 * n + c2 * n * (start + (n + 1) / 2) + c3

    def max_chunk(self, start: int, seconds: float) -> int:
        """The most prompt tokens a chunk starting after `start` cached tokens may compute
        within `seconds` of a step's time (its row, tokens and attention), 0 when none."""
        _, c1, c2, c3 = self.coefficients
        left = seconds - c3
        if left <= 0:
            return 0
        # NOTE: n tokens cost c1 n + c2 n (start + (n + 1) / 2) = a n^2 + b n
        a, b = c2 / 2, c1 + c2 * (start + 0.5)
        if a <= 0:
            return int(left / b) if b > 0 else 2**31 - 1
        n = (-b + (b * b + 4 * a * left) ** 0.5) / (2 * a)
        return max(0, int(n))
