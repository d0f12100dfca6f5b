"""Shared fixtures: the default SmolLM2 checkpoint and tiny random models saved to disk, so
every engine in the tests loads through the real loading code."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NOTE: the suite checks the float32 contract (greedy output equal to transformers' token for
# token) through dtype="auto", which picks bfloat16 on CPUs with bfloat16 matrix units: keep
# "auto" at float32 here, in subprocesses too (TP ranks, servers). The bfloat16 tests ask for
# it explicitly, and tests/test_bf16.py checks what "auto" picks without this override.
os.environ.setdefault("LMENGINE_CPU_DTYPE", "float32")


TESTS_DIR = Path(__file__).resolve().parent

# The kind of every test file: a marker (registered in pyproject.toml), so `pytest -m engine`
# runs one kind. docs/testing.md has the same map; tests/test_repo.py checks that both name
# every file. A folder is one kind as a whole.
FOLDER_KINDS = {"kernels": "kernel", "gpu": "gpu"}
TEST_KINDS = {
    "unit": [
        "test_adapter_manager.py",
        "test_bench.py",
        "test_bounds.py",
        "test_config_and_patch.py",
        "test_detokenize.py",
        "test_gguf_blocks.py",
        "test_imports.py",
        "test_malloc.py",
        "test_models_registry.py",
        "test_policies.py",
        "test_prefix_cache.py",
        "test_qos.py",
        "test_repo.py",
        "test_scheduler.py",
        "test_scheduler_swap.py",
        "test_step_budget.py",
        "test_step_context.py",
        "test_server_metrics.py",
        "test_server_penalties.py",
        "test_server_streaming.py",
    ],
    "engine": [
        "test_decode_loop.py",
        "test_engine.py",
        "test_burst.py",
        "test_first_token.py",
        "test_kept_rows.py",
        "test_kv_pool_sizing.py",
        "test_kv_prefault.py",
        "test_pipeline.py",
        "test_policies_engine.py",
        "test_sampling.py",
        "test_step_faults.py",
        "test_streaming_cost.py",
        "test_structured_outputs.py",
    ],
    "parity": [
        "test_beam_search.py",
        "test_bf16.py",
        "test_gguf_models.py",
        "test_hf_parity.py",
        "test_kv_int8.py",
        "test_lora.py",
        "test_mla.py",
        "test_models_parity.py",
        "test_prefix_cache_engine.py",
        "test_research.py",
        "test_smollm2_parity.py",
        "test_speculative.py",
        "test_swap.py",
        "test_w8a8.py",
        "test_w8a8_bf16.py",
        "test_w8a8_smollm2.py",
    ],
    "server": [
        "test_cli.py",
        "test_lm_eval.py",
        "test_router.py",
        "test_server.py",
        "test_server_adapters.py",
        "test_server_anthropic.py",
        "test_server_embeddings.py",
        "test_server_frameworks.py",
        "test_server_responses.py",
        "test_server_lifecycle.py",
        "test_server_lora.py",
        "test_server_scoring.py",
        "test_server_strict.py",
        "test_server_structured.py",
        "test_server_tools.py",
        "test_server_uptime.py",
        "test_soak.py",
    ],
    "tp": [
        "test_tp.py",
        "test_tp_lora.py",
        "test_tp_torchrun.py",
        "test_tp_uptime.py",
        "test_tp_w8a8.py",
    ],
}
_KIND_OF_FILE = {name: kind for kind, names in TEST_KINDS.items() for name in names}


def kind_of(path: Path) -> str | None:
    """The kind of the test file at `path`, None for a file the map does not name."""
    try:
        parts = Path(path).resolve().relative_to(TESTS_DIR).parts
    except ValueError:  # not under tests/
        return None
    if len(parts) > 1:
        return FOLDER_KINDS.get(parts[0])
    return _KIND_OF_FILE.get(parts[0])


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = kind_of(item.path)
        if kind is not None:
            item.add_marker(kind)
    # NOTE: LMENGINE_GPU_TESTS_ON_CPU=1 runs the gpu tests on the CPU, a dry run of their logic
    # (tests/gpu, docs/gpu.md)
    if torch.cuda.is_available() or os.environ.get("LMENGINE_GPU_TESTS_ON_CPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_global_rng(request):
    """Each test draws its unseeded random data from the same seed whatever ran before it, so
    a test that passes alone passes in the suite and a failure replays. LMENGINE_TEST_SEED
    shifts every seed, to hunt tolerances that only hold for lucky data."""
    shift = int(os.environ.get("LMENGINE_TEST_SEED", "0"))
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) + shift)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from lmengine.engine.loader import resolve_model_path

    return resolve_model_path(None)


def save_tiny_llama(path, tokenizer_src: str, seed: int = 0, **overrides) -> str:
    """A randomly initialised Llama with GQA and SmolLM2's tokenizer, saved with save_pretrained."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    params = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    params.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**params))
    # NOTE: default init gives near-uniform logits; scale up so greedy choices are decisive
    # and the tiny model behaves like a trained one would (non-degenerate, varied tokens).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm2_path)


@pytest.fixture(scope="module")
def tiny_w8a8_path(tmp_path_factory, tiny_llama_path) -> str:
    """The tiny Llama quantized by `lmengine quantize w8a8` (4 calibration samples of 32
    tokens), the checkpoint of the W8A8 tests on CPU, with TP and on the device."""
    from lmengine.cli import main

    out = tmp_path_factory.mktemp("tiny_w8a8")
    argv = ["quantize", "w8a8", tiny_llama_path, "--out", str(out)]
    assert main(argv + ["--calib-samples", "4", "--calib-seqlen", "32", "--quiet"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, smollm2_path) -> str:
    """A tiny Llama with tied embeddings (seed 5): the float model that the GGUF tests write
    as GGUF files and compare with."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny_gguf_src"), smollm2_path, seed=5, tie_word_embeddings=True
    )


@pytest.fixture(scope="module")
def adapter_paths(tiny_llama_path, tmp_path_factory) -> dict[str, str]:
    """The peft adapters of tests/test_lora.py's ADAPTERS for the tiny Llama, saved to disk."""
    from tests.test_lora import ADAPTERS, save_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_adapter(tiny_llama_path, root / name, seed=i, **args)
        for i, (name, args) in enumerate(ADAPTERS.items())
    }
