"""Keep freed memory in the process (glibc), so that large tensors do not fault in every step.

glibc's malloc serves a block of 32 MB or more (less while its dynamic threshold is low) with
its own `mmap` and unmaps it when it is freed; it also returns the free top of a heap to the
OS. A CPU forward allocates such blocks for every large activation (a 4,096-token prefill
step's MLP output is 50 MB), so every step faulted their pages in again, one 4 KiB page at a
time, zero-filled by the kernel. Measured on an Intel Xeon (family 6, model 167, 2 cores), all
of SmolLM2-135M's linears at 4,096 rows, on a thread as the engine runs them: 338 GFLOP/s as
glibc comes, 385 with the first two settings below (either alone: 339 and 300); offline, 8
prompts of 1,016 tokens 1,006 -> 1,129 prompt tok/s and 64 chat prompts 505 -> 520 output
tok/s.

A thread other than the main one allocates from heaps of 64 MB, and glibc unmaps a heap
again as soon as the last block in it is freed. A step whose live tensors come near 64 MB
opened a heap for one layer's block and unmapped it when the layer was done, layer after
layer: a prompt step of 2,200 rows on SmolLM2 faulted 26,000-107,000 pages in and took
416-611 ms where one of 2,100 rows faulted none and took 270-300. With a top pad of a whole
heap (`_TOP_PAD`) every heap is opened at its full size and stays: the same steps faulted
0-6,000 pages in, 293-390 ms (Intel Xeon, 2 cores, bfloat16, 2026-12-04).

The price: memory the engine freed stays with the process while it works (its resident size
is that of its largest step) instead of going back to the OS. Once the engine has been idle
for `IDLE_RELEASE_S`, its loop hands that memory back (`release_idle_memory`), so an idle
server's resident size does not keep the high-water mark of the traffic it has seen. It
applies to the whole process, once, when an engine on the CPU starts;
`LMENGINE_KEEP_FREED_MEMORY=0` leaves glibc's defaults alone. Other C libraries (musl, macOS)
are left alone.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters of glibc's malloc.h
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heaps (and are reused); glibc accepts up to half its
# per-thread heap size (64 MB), so larger blocks still get their own mapping.
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of a heap before it is returned
# A heap is made (and kept) with this much room beyond the block it was made for; a thread's
# heap is at most 64 MB, so it is opened whole and not unmapped while memory is kept
_TOP_PAD = 64 << 20
IDLE_RELEASE_S = 2.0  # seconds without a step before the engine loop releases freed memory
_applied = False


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above, once per process; True when the settings are in force."""
    global _applied
    if _applied:
        return True
    if os.environ.get("LMENGINE_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith(
        "linux"
    ):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has no such symbol
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    ok = mallopt(_M_TOP_PAD, _TOP_PAD) == 1 and ok
    if not ok:
        logger.warning("glibc refused the malloc settings: large CPU tensors fault in each step")
    _applied = ok
    return ok


def release_freed_memory(device) -> None:
    """Hand the memory freed so far back to the system: glibc's `malloc_trim` where the
    settings above keep it, the caching allocator's blocks on CUDA. Called after a model's
    float weights were replaced by smaller ones (GGUF blocks), so that sizing the KV pool from
    the free memory sees them gone."""
    gc.collect()  # replaced modules can sit in reference cycles
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    else:
        release_idle_memory()


def release_idle_memory() -> bool:
    """`malloc_trim`: give the free memory of every heap back to the OS, where the settings
    above keep it (the engine loop calls this once it has been idle for `IDLE_RELEASE_S`).
    True when memory was released."""
    if not _applied:
        return False
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False
