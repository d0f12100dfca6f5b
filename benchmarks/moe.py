"""Mixture-of-experts layer on CPU: lmengine's patched Mixtral block (routing + fused_moe,
grouped by expert) against transformers' MixtralSparseMoeBlock, same weights, same run, with
transformers' two expert implementations: "grouped_mm" (what `from_pretrained` picks) and
"eager" (a loop over the experts that have tokens).

    python benchmarks/moe.py            # Mixtral-like proportions at a reduced width
    python benchmarks/moe.py --quick    # a smoke test with small sizes

Prints the median time per call of each and the ratios (transformers / lmengine: above 1
means lmengine is faster), after checking that all give the same output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _median_ms(fn, x, repeat: int) -> float:
    fn(x)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/moe.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=1792)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", default="1,16,64,512", help="comma-separated token counts")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.hidden, args.inter, args.tokens, args.repeat = 64, 128, "1,32", 3

    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from lmengine.models.mistral import PatchedMixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    torch.manual_seed(0)
    blocks = {}
    for impl in ("grouped_mm", "eager", "lmengine"):
        config._experts_implementation = None if impl == "lmengine" else impl
        blocks[impl] = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in blocks["eager"].parameters():
            p.normal_(0, 0.02)
    for block in blocks.values():
        block.load_state_dict(blocks["eager"].state_dict())
    blocks["lmengine"].__class__ = PatchedMixtralSparseMoeBlock
    blocks["lmengine"].lmengine_post_patch()
    print(
        f"hidden {args.hidden}, intermediate {args.inter}, {args.experts} experts, "
        f"top-{args.top_k}, float32, {torch.get_num_threads()} threads"
    )
    print(
        f"{'tokens':>7} {'grouped_mm ms':>14} {'eager ms':>9} {'lmengine ms':>12} "
        f"{'ratio vs grouped_mm':>20} {'ratio vs eager':>15}"
    )
    with torch.inference_mode():
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(num_tokens, args.hidden)
            expected = blocks["eager"](x[None])[0]
            torch.testing.assert_close(blocks["grouped_mm"](x[None])[0], expected)
            torch.testing.assert_close(blocks["lmengine"](x), expected, rtol=1e-4, atol=1e-5)
            t = {
                impl: _median_ms(lambda v, b=block: b(v[None]), x, args.repeat)
                for impl, block in blocks.items()
                if impl != "lmengine"
            }
            t["lmengine"] = _median_ms(blocks["lmengine"], x, args.repeat)
            print(
                f"{num_tokens:>7} {t['grouped_mm']:>14.2f} {t['eager']:>9.2f} "
                f"{t['lmengine']:>12.2f} {t['grouped_mm'] / t['lmengine']:>20.2f} "
                f"{t['eager'] / t['lmengine']:>15.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
