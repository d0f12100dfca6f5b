"""Mixture-of-experts layer on CPU: lmengine's `fused_moe` (with the routing) against
transformers' own eager sparse block, same weights, same process, interleaved.

Two layers: a Qwen3-MoE block (hidden 2048, 128 experts, top-8, moe_intermediate_size 768,
SiLU, no biases: Qwen3MoeSparseMoeBlock) and a gpt-oss one (hidden 2880, 32 experts, top-4,
intermediate 2880, biased experts, ClampedSwiGLU: GptOssMLP), each built by transformers from a
config with random weights; lmengine runs a copy of that module patched as the engine patches
it (its routing and `fused_moe`, the experts prepared as the engine prepares them at the first
forward: gpt-oss's converted to fused_moe's layout, both moved to huge pages where Linux has
them; `--pages 4k` keeps them where they are). transformers runs its "eager" experts (a loop
over the experts that have tokens).

Every call gets fresh tokens (so fresh routing), and before each call the last-level cache is
flushed by reading a buffer larger than it: the weights come from memory, as in a real forward
where the other layers' weights pass through the cache in between (`--no-flush` to skip). A
read, not a write: written lines would be written back during the next call, taking memory
bandwidth a real forward does not lose.
Each round runs both systems, alternating which goes first; the table gives the median time per
call over all rounds, the spread (min-max) and the ratio of the medians (transformers /
lmengine: above 1 means lmengine is faster).

    python benchmarks/moe.py                      # both layers, float32 and bfloat16
    python benchmarks/moe.py --layers qwen3-moe --dtypes bfloat16 --tokens 64
    python benchmarks/moe.py --quick              # a smoke test with small sizes
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from copy import deepcopy
from pathlib import Path

import torch

LAYERS = ("qwen3-moe", "gpt-oss")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (sysfs), 512 MiB where unknown."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=512 << 20)


class Qwen3MoeLayer:
    """transformers' Qwen3MoeSparseMoeBlock, and a copy patched as lmengine patches it."""

    def __init__(self, dtype: torch.dtype, quick: bool) -> None:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        from lmengine.models.qwen import PatchedQwen3MoeSparseMoeBlock

        size = dict(hidden_size=64, moe_intermediate_size=32) if quick else {}
        config = Qwen3MoeConfig(
            **(size or dict(hidden_size=2048, moe_intermediate_size=768)),
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
        )
        config._experts_implementation = "eager"
        self.hidden = config.hidden_size
        self.block = _random_module(Qwen3MoeSparseMoeBlock(config), dtype)
        self.patched = _patched_copy(self.block, PatchedQwen3MoeSparseMoeBlock)
        self.describe = (
            f"Qwen3-MoE: hidden {config.hidden_size}, {config.num_experts} experts, "
            f"top-{config.num_experts_per_tok}, intermediate {config.moe_intermediate_size}, "
            "SiLU, no biases"
        )

    def transformers(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x[None])[0]

    def lmengine(self, x: torch.Tensor) -> torch.Tensor:
        return self.patched(x)


class GptOssLayer:
    """transformers' GptOssMLP, and a copy patched as lmengine patches it (its experts turned
    to fused_moe's layout at the first call: gate and up de-interleaved, the matrices
    transposed)."""

    def __init__(self, dtype: torch.dtype, quick: bool) -> None:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        from lmengine.models.gpt_oss import PatchedGptOssMLP

        width = 64 if quick else 2880
        config = GptOssConfig(
            hidden_size=width,
            intermediate_size=width,
            num_local_experts=32,
            num_experts_per_tok=4,
        )
        config._experts_implementation = "eager"
        self.hidden = config.hidden_size
        self.mlp = _random_module(GptOssMLP(config), dtype)
        self.patched = _patched_copy(self.mlp, PatchedGptOssMLP)
        self.describe = (
            f"gpt-oss: hidden {config.hidden_size}, {config.num_local_experts} experts, "
            f"top-{config.num_experts_per_tok}, intermediate {config.intermediate_size}, "
            "biases, ClampedSwiGLU"
        )

    def transformers(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x[None])[0][0]

    def lmengine(self, x: torch.Tensor) -> torch.Tensor:
        return self.patched(x)


def _patched_copy(module: torch.nn.Module, patched_class: type) -> torch.nn.Module:
    """A copy of `module` (its own weights) turned into lmengine's patched class, as
    lmengine.models.patch does to a loaded model."""
    copy = deepcopy(module)
    copy.__class__ = patched_class
    copy.lmengine_post_patch()
    return copy


def _random_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    module = module.to(dtype).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def _time_call(fn, x: torch.Tensor, flush: torch.Tensor | None) -> float:
    if flush is not None:
        flush.sum()  # NOTE: evicts the weights of the call before from every cache
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def bench(layer, num_tokens: int, dtype, rounds: int, calls: int, flush) -> dict[str, list[float]]:
    """Seconds per call of each system: `rounds` rounds of `calls` calls each, fresh tokens per
    call, the order of the two systems swapped every round."""
    systems = {"transformers": layer.transformers, "lmengine": layer.lmengine}
    x = torch.randn(num_tokens, layer.hidden).to(dtype)
    expected = layer.transformers(x)
    got = layer.lmengine(x)
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * float(expected.float().abs().max())
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for name in order:
            for _ in range(calls):
                x = torch.randn(num_tokens, layer.hidden).to(dtype)
                times[name].append(_time_call(systems[name], x, flush))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/moe.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument(
        "--layers", default=",".join(LAYERS), help="comma-separated: " + ", ".join(LAYERS)
    )
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", default="1,8,64,256", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per system per round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--no-flush", action="store_true", help="keep the caches between calls")
    parser.add_argument("--quick", action="store_true", help="small sizes, few calls")
    parser.add_argument(
        "--pages",
        choices=("huge", "4k"),
        default="huge",
        help="where lmengine's experts live: on huge pages as the engine places them, or left "
        "on the 4 KiB pages the module was built on",
    )
    args = parser.parse_args(argv)
    if args.pages == "4k":
        from lmengine.kernels import huge_pages

        huge_pages.huge_pages_available = lambda: False
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.calls = 2, 1

    import transformers

    print(f"{cpu_model()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    print(
        f"{datetime.datetime.now().isoformat(timespec='minutes')}, load average (1 min) "
        f"{os.getloadavg()[0]:.2f} at the start"
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"lmengine's experts on {'huge' if args.pages == 'huge' else '4 KiB'} pages")
    flush = None
    if not args.no_flush and not args.quick:
        flush = torch.ones(last_level_cache_bytes() * 5 // 4 // 4)  # float32
        print(f"cache flush: {flush.numel() * 4 >> 20} MiB read before each call")
    builders = {"qwen3-moe": Qwen3MoeLayer, "gpt-oss": GptOssLayer}
    with torch.inference_mode():
        for name in args.layers.split(","):
            for dtype_name in args.dtypes.split(","):
                dtype = getattr(torch, dtype_name)
                torch.manual_seed(0)
                layer = builders[name](dtype, args.quick)
                print(f"\n{layer.describe}, {dtype_name}")
                print(f"{'tokens':>7} {'transformers ms':>22} {'lmengine ms':>22} {'ratio':>6}")
                for num_tokens in (int(t) for t in args.tokens.split(",")):
                    times = bench(layer, num_tokens, dtype, args.rounds, args.calls, flush)
                    cells = {}
                    for system, ts in times.items():
                        ms = [t * 1e3 for t in ts]
                        cells[system] = (
                            statistics.median(ms),
                            f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})",
                        )
                    ratio = cells["transformers"][0] / cells["lmengine"][0]
                    print(
                        f"{num_tokens:>7} {cells['transformers'][1]:>22} "
                        f"{cells['lmengine'][1]:>22} {ratio:>6.2f}"
                    )
                del layer
    return 0


if __name__ == "__main__":
    sys.exit(main())
