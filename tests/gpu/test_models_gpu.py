"""Every architecture of MODULE_MAP through the Triton kernels: a tiny random model of each
(tests/test_models_parity.py: sliding windows shorter than the prompts, Gemma 2's soft caps,
Mixtral's experts, partial rotary, OPT's learned positions) generates on the device what
transformers generates there in float32, every request arriving in one step at a pool small
enough to force preemption (the CPU test's "preempt" configuration)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from lmengine import Engine, GenerationConfig
from tests.engine_utils import random_prompts
from tests.gpu.common import (
    FP32_LOGPROB_TOL,
    FP32_TIE_MARGIN,
    check_greedy_against,
    engine_config,
    hf_greedy_reference,
    load_hf,
    release_device_memory,
)
from tests.test_models_parity import (
    ARCHITECTURES,
    ENGINE_CONFIGS,
    LENGTHS,
    NEW_TOKENS,
    save_tiny_model,
)
from tests.test_swap import final_responses, submit_at_once

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_case(request, tmp_path_factory, smollm2_path, device):
    name = request.param
    path = save_tiny_model(tmp_path_factory.mktemp(f"gpu_{name}"), smollm2_path, name)
    prompts = random_prompts(LENGTHS, AutoConfig.from_pretrained(path).vocab_size, seed=2)
    model = load_hf(path, torch.float32, device)
    try:
        return name, path, prompts, hf_greedy_reference(model, prompts, NEW_TOKENS)
    finally:
        del model
        release_device_memory()


def test_architecture_matches_transformers(arch_case, triton_spy):
    name, path, prompts, refs = arch_case
    cfg = engine_config(dtype="float32", **ENGINE_CONFIGS["preempt"])
    with Engine.from_pretrained(path, cfg) as engine:
        arch = type(engine.model_agent.model).__name__
        assert arch.startswith("Patched"), f"{name} ran unpatched as {arch}"
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, logprobs=1)
        got = final_responses(submit_at_once(engine, prompts, gen))
        check_greedy_against(got, refs, FP32_TIE_MARGIN, FP32_LOGPROB_TOL, 0.9)
        stats = engine.stats()
        assert stats["num_preemptions"] > 0, "the small pool was meant to force preemption"
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.check_integrity()
    kernels = ["paged_attention_triton", "fill_kv_cache_triton"]
    if name == "mixtral":
        kernels.append("fused_moe_triton")
    triton_spy.assert_ran(*kernels)
