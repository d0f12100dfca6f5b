"""The cyclic garbage collector beside a loaded model.

Loading a model leaves a large heap of long-lived objects (torch's, transformers' and the
tokenizer's, the patched modules) that every full collection scans again. With SmolLM2 loaded a
full collection took 70-245 ms, holding the GIL: the step running then, or the server's event
loop, stopped that long, two or three times per `vllm bench serve` load. `freeze` moves every
object alive into the collector's permanent generation once an engine is built (gc.freeze, as
vLLM's engine does), so a full collection scans only what came after: 5-8 ms. When the last
engine of the process closes, `thaw` gives the frozen objects back to the collector, so a
process that builds and closes engines (tests, scripts) frees what they left in cycles.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_num_engines = 0  # built and not yet closed


def freeze() -> None:
    """An engine was built: freeze every object alive now."""
    global _num_engines
    with _lock:
        _num_engines += 1
        gc.freeze()


def thaw() -> None:
    """An engine closed: when it was the last one, unfreeze the heap."""
    global _num_engines
    with _lock:
        _num_engines = max(0, _num_engines - 1)
        if _num_engines == 0:
            gc.unfreeze()


def num_engines() -> int:
    """Engines that keep the heap frozen."""
    return _num_engines
