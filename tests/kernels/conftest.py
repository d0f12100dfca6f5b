"""Kernel-test setup: run Triton kernels with the interpreter on CPU unless told otherwise.

TRITON_INTERPRET must be in the environment before triton is imported (and before the kernel
modules are: `triton.jit` picks the interpreter when it decorates), so it is set here, at
conftest import time; the tests import the launchers inside the test functions. Set
TRITON_INTERPRET=0 to run the Triton tests on a CUDA device instead.
"""

from __future__ import annotations

import os

import pytest

# NOTE: before anything imports triton (torch does not import it at module import)
os.environ.setdefault("TRITON_INTERPRET", "1")

from lmengine.kernels import cpu_ext  # noqa: E402  (after TRITON_INTERPRET is set)


def _triton_interpret() -> bool:
    """Whether triton runs kernels in its interpreter; skips the test if triton is missing."""
    try:
        import triton
    except ImportError as exc:
        pytest.skip(f"triton cannot be imported ({type(exc).__name__}: {exc})")
    return bool(triton.knobs.runtime.interpret)


@pytest.fixture(scope="session")
def triton_device() -> str:
    """Device for Triton-launcher tests: "cpu" under the interpreter, else "cuda"."""
    if _triton_interpret():
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is off and no CUDA device is available")
    return "cuda"


@pytest.fixture(scope="session")
def triton_interpreted(triton_device: str) -> bool:
    """True when the Triton kernels run in the interpreter (CPU tensors)."""
    return triton_device == "cpu"


@pytest.fixture(params=["compiled", "eager"])
def cpu_path(request, monkeypatch):
    """Run a CPU test through the compiled kernels (csrc/*.cpp), then through the eager
    torch fallback used where they are not built."""
    if request.param == "compiled":
        assert cpu_ext.load() is not None, "the compiled CPU kernels did not build"
    else:
        monkeypatch.setattr(cpu_ext, "load", lambda: None)
    return request.param


@pytest.fixture(scope="session")
def ext():
    """The compiled CPU kernels. NOTE: a missing compiler is a broken install here (setup.sh
    builds the kernels), not a reason to skip: the engine's speed depends on them."""
    module = cpu_ext.load()
    assert module is not None, "the CPU kernels failed to build (see the warning above)"
    return module


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Kernels split their work differently with one thread and with several: run both,
    whatever the machine's core count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
