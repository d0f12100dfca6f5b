"""A model on its GGUF blocks (quant_policy="gguf") on the device: tiny random Llamas written as
GGUF files (Q4_0, Q4_1, Q8_0, mixed within the merged linears) compute through the Triton GEMM
on the blocks and generate, in float32, what transformers generates on the file's float32
expansion on the same device (the near-tie rule of tests/gpu/common.py)."""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, GenerationConfig
from lmengine.engine.loader import resolve_model_path
from tests.engine_utils import random_prompts, run_threads
from tests.gpu.common import (
    FP32_LOGPROB_TOL,
    FP32_TIE_MARGIN,
    ON_CPU,
    check_greedy_against,
    engine_config,
    hf_greedy_reference,
    load_hf,
    release_device_memory,
)
from tests.test_gguf_models import LAYOUTS, write_llama_gguf

pytestmark = pytest.mark.gpu

NEW_TOKENS = 12


@pytest.mark.parametrize("layout", ["q4_0", "mixed"])
def test_gguf_blocks_on_the_device_follow_transformers(
    tmp_path, tiny_hf, layout, device, triton_spy
):
    path = write_llama_gguf(tmp_path / f"tiny-{layout}.gguf", tiny_hf, LAYOUTS[layout])
    expanded = resolve_model_path(path)
    prompts = random_prompts([1, 6, 19, 40], 49152, seed=3)
    model = load_hf(expanded, torch.float32, device)
    try:
        reference = hf_greedy_reference(model, prompts, NEW_TOKENS)
    finally:
        del model
        release_device_memory()
    cfg = engine_config(dtype="float32", quant_policy="gguf", block_size=16, num_gpu_blocks=64)
    with Engine.from_pretrained(path, cfg) as engine:
        kinds = [type(m).__name__ for m in engine.model_agent.runner.model.modules()]
        assert kinds.count("GGUFLinear") == 2 * 4
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, logprobs=1)
        got = run_threads(engine, prompts, gen)
        check_greedy_against(got, reference, FP32_TIE_MARGIN, FP32_LOGPROB_TOL, 0.9)
        engine.check_integrity()
    triton_spy.assert_ran("gguf_gemm_triton")


def test_the_kv_pool_sees_the_smaller_weights(smollm2_path):
    """On the device, the float32 weights the blocks replace are handed back before the KV
    pool is sized from the free memory: SmolLM2 on its Q4_1 blocks gets a larger pool. (On
    the CPU the float checkpoint is memory-mapped, and its pages count as available either
    way.)"""
    if ON_CPU:
        pytest.skip("the CPU sizes the pool from available memory, mapped weights included")
    num_blocks = {}
    for policy in ("float", "gguf"):
        with Engine.from_pretrained(None, engine_config(quant_policy=policy)) as engine:
            num_blocks[policy] = engine.model_agent.cache_engine.num_gpu_blocks
        release_device_memory()
    assert num_blocks["gguf"] > num_blocks["float"], num_blocks
