"""Tensor parallelism on torch.distributed: `EngineConfig(tp=N)`.

- `comm`: the process group of this rank and its collectives.
- `shard`: sharding a patched model per its declared plan; reading only this rank's slices.
- `load`: one rank's shard, from config to loaded weights.
- `step`: a step's inputs on the wire and the step every rank runs.
- `agent`: `TPModelAgent`, rank 0 in the engine process, which starts and watches the workers.
- `worker`: ranks 1..N-1 (`python -m lmengine.distributed.worker`).
"""

from __future__ import annotations

import importlib

# NOTE: lazy, so that `python -m lmengine.distributed.worker` does not import itself twice
_EXPORTS = {name: "lmengine.distributed.agent" for name in ("TPModelAgent", "TPWorkerError")}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lmengine.distributed' has no attribute {name!r}")
