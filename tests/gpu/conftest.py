"""GPU-test setup: the device, compiled Triton on CUDA (the interpreter in the CPU dry run), a
spy that counts Triton launches, and the device memory handed back after every test.

TRITON_INTERPRET decides, when a kernel module is imported, whether `triton.jit` compiles or
interprets; tests/kernels/conftest.py defaults it to 1 (interpreter) for the CPU suite. This
file is imported first (tests/gpu sorts before tests/kernels), so on a CUDA machine it sets 0
before anything imports a kernel (without CUDA, 1, as the kernel tests need); an explicit
TRITON_INTERPRET wins, and then the `_triton_matches_the_device` check fails every GPU test
with the reason instead of testing the interpreter on CUDA tensors.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.gpu.common import DEVICE, ON_CPU, release_device_memory

# NOTE: without CUDA (the default CPU suite, where these tests are skipped) the interpreter,
# as tests/kernels/conftest.py sets it: this file is imported first, and a kernel module
# imported now without it would stay compiled for the whole run
if ON_CPU or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    os.environ.setdefault("TRITON_INTERPRET", "0")

# module of lmengine.kernels.triton -> its launchers that the dispatchers import per call
TRITON_LAUNCHERS = {
    "paged_attention": ["paged_attention_triton"],
    "fill_kv_cache": ["fill_kv_cache_triton"],
    "rms_norm": ["rms_norm_triton", "add_rms_norm_triton"],
    "rotary": ["apply_rotary_triton"],
    "lora": ["lora_add_triton"],
    "w8a8": ["per_token_quant_triton", "rms_norm_quant_triton", "int8_gemm_triton"],
    "moe": ["fused_moe_triton"],
    "gguf": ["gguf_gemm_triton"],
}


@pytest.fixture(scope="session", autouse=True)
def _triton_matches_the_device():
    """Compiled kernels on CUDA, the interpreter in the dry run; anything else fails."""
    import triton

    interpreted = bool(triton.knobs.runtime.interpret)
    if interpreted != ON_CPU:
        pytest.fail(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} on {DEVICE.type}: the GPU "
            "tests need compiled Triton on CUDA (unset TRITON_INTERPRET and run `pytest -m "
            "gpu`) and the interpreter in the CPU dry run"
        )


@pytest.fixture(scope="session", autouse=True)
def _one_thread_in_the_dry_run():
    """The dry run computes on one CPU thread (engines too: engine_config): on a shared
    2-core machine, two threads' spin-waits made transformers' generate 15x slower."""
    if not ON_CPU:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _release_device_memory():
    """Engines and references hold GBs of device memory: hand it back after each test."""
    yield
    release_device_memory()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return DEVICE


class TritonSpy:
    """Counts calls of the Triton launchers (engines call them from their loop thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        for module_name, names in TRITON_LAUNCHERS.items():
            module = importlib.import_module(f"lmengine.kernels.triton.{module_name}")
            for name in names:
                monkeypatch.setattr(module, name, self._counting(name, getattr(module, name)))

    def _counting(self, name: str, fn):
        def wrapper(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    def assert_ran(self, *names: str) -> None:
        """On CUDA each named launcher ran (the engine took the Triton path); on the CPU none
        of them did (the CPU engine keeps its own paths)."""
        for name in names:
            count = self.calls.get(name, 0)
            if DEVICE.type == "cuda":
                assert count > 0, f"{name} never ran: the CUDA engine bypassed the Triton kernel"
            else:
                assert count == 0, f"{name} ran {count} times on the CPU"


@pytest.fixture
def triton_spy(monkeypatch) -> TritonSpy:
    return TritonSpy(monkeypatch)
