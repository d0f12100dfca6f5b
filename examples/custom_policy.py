"""Add a scheduling policy without touching the scheduler: shortest remaining work first (SRPT).

    python examples/custom_policy.py [model]      # default model: SmolLM2-135M-Instruct

A policy is a `key(seq, now)` that sorts ascending: the smallest key is served (admitted,
swapped back in) first, the largest running one is preempted first when blocks run out.
`priority_aging_s` works for it too (waiting time counts as priority levels).
"""

from __future__ import annotations

import sys

from lmengine import EngineConfig, GenerationConfig, pipeline
from lmengine.scheduler import Policy, register_policy


@register_policy("srpt")
class ShortestRemainingFirst(Policy):
    """The request with the fewest tokens left to generate goes first; ties by arrival."""

    def key(self, seq, now):
        return (seq.max_new_tokens - seq.num_generated_tokens, seq.arrival_time, seq.seq_id)


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    cfg = EngineConfig(scheduling_policy="srpt", max_batch_size=1)
    prompts = ["Write a long story about a dragon.", "Say hi.", "Name three colours."]
    gens = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (48, 4, 12)]
    with pipeline(model, engine_config=cfg) as pipe:
        finished = []
        for delta in pipe.stream_infer(prompts, gen_config=gens):
            if delta.finish_reason is not None:
                finished.append(delta.index)
        # the first prompt may start before the others arrive; the rest go shortest first
        print("finished in order:", [prompts[i] for i in finished])


if __name__ == "__main__":
    main()
