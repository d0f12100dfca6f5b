"""Throughput of lmengine against transformers, in one process: the same as `lmengine bench`.

    python benchmarks/throughput.py                      # W1, W2, W3 at full size
    python benchmarks/throughput.py --workloads w1 --repeat 3 --json results.json
    python benchmarks/throughput.py --quick              # a smoke test with small sizes

See `lmengine/bench` for what each workload measures.
"""

from __future__ import annotations

import argparse
import sys

from lmengine.bench import add_bench_flags, run_benchmarks


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and run the benchmark."""
    parser = argparse.ArgumentParser(
        prog="benchmarks/throughput.py",
        description="lmengine vs transformers throughput (float32, CPU), in one run",
        allow_abbrev=False,
    )
    add_bench_flags(parser)
    args = parser.parse_args(argv)
    try:
        return run_benchmarks(args)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
