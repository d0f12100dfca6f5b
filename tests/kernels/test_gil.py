"""The compiled kernels release the GIL while they run, as torch's operators do: other Python
threads (a server's event loop, its tokenizers) keep running through a long kernel call."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import torch

from lmengine.kernels import cpu_ext

CSRC = Path(cpu_ext.__file__).resolve().parent / "csrc"


def test_every_binding_releases_the_gil():
    bindings = []
    for path in sorted(CSRC.glob("*.cpp")):
        bindings += [
            (path.name, m) for m in re.findall(r"m\.def\((.*?)\);", path.read_text(), re.S)
        ]
    assert len(bindings) >= 20
    held = [(name, b.split(",")[0]) for name, b in bindings if "release_gil()" not in b]
    assert not held, f"bound without release_gil(): {held}"


def ticks_during(call) -> tuple[int, float]:
    """How often this thread wakes from 1 ms sleeps while `call` runs once in another thread;
    and the call's duration in seconds. A call that holds the GIL allows at most ~1 wake-up."""
    started, times = threading.Event(), []

    def worker():
        started.set()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    ticks = 0
    while thread.is_alive():
        time.sleep(0.001)
        ticks += 1
    thread.join()
    return ticks, times[0]


def big_calls(ext):
    """(name, zero-argument call running the kernel `reps` times, reps) for kernels that each
    run 10 ms or more here."""
    gen = torch.Generator().manual_seed(0)
    x8 = torch.randn(8, 4096, generator=gen)
    w = torch.randn(16384, 4096, generator=gen)  # 256 MB: a memory-bound GEMV
    gate_up = torch.randn(4096, 8192, generator=gen)
    norm_w = torch.ones(8192)
    calls = [
        ("gemv", lambda: [ext.gemv(x8, w) for _ in range(4)], 4),
        ("silu_mul", lambda: [ext.silu_mul(gate_up) for _ in range(4)], 4),
        ("rms_norm", lambda: [ext.rms_norm(gate_up, norm_w, 1e-6) for _ in range(4)], 4),
    ]
    if ext.sgemm_packed_available():
        x = torch.randn(2048, 4096, generator=gen)
        square = w[:4096].contiguous()
        packed = ext.sgemm_pack(square, 2048)
        calls.append(("sgemm_packed_linear", lambda: ext.sgemm_packed_linear(x, packed, square), 1))
    return calls


def test_long_kernel_calls_let_other_threads_run(ext):
    for name, call, reps in big_calls(ext):
        call()  # warm: first-touch faults and thread start-up outside the measurement
        ticks, seconds = ticks_during(call)
        ms = seconds * 1e3
        assert ms > 10 * reps, f"{name} ran only {ms:.1f} ms for {reps} calls: make it longer"
        # with the GIL held through each call this thread could wake about once per call
        assert ticks >= 3 * reps, f"{name}: {ticks} wake-ups during {reps} calls, {ms:.0f} ms"
