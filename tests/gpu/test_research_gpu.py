"""The research hooks on the device: SmolLM2's prompt logprobs and hidden states equal
transformers' float32 forward on the same device, batched and chunked; a steering vector
gives transformers' output with the same vector added by a forward hook, and leaves the
other requests of the batch as they are. Tolerances and the near-tie rule: common.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from lmengine import Engine, GenerationConfig
from lmengine.config import SteeringVector
from tests.engine_utils import run_threads
from tests.gpu.common import (
    FP32_LOGPROB_TOL,
    FP32_TIE_MARGIN,
    by_mode,
    chat_prompts,
    check_greedy_against,
    engine_config,
    hf_greedy_reference,
    load_hf,
    release_device_memory,
)

pytestmark = pytest.mark.gpu

NUM_PROMPTS, NEW_TOKENS = by_mode(gpu=(8, 24), cpu=(3, 8))
LAYER = 15


@pytest.fixture(scope="module")
def prompts(smollm2_path) -> list[list[int]]:
    return chat_prompts(AutoTokenizer.from_pretrained(smollm2_path), NUM_PROMPTS)


def test_prompt_logprobs_and_hidden_states_match_transformers(smollm2_path, prompts, device):
    cfg = GenerationConfig(max_new_tokens=0, prompt_logprobs=2, output_hidden_states=(LAYER, 30))
    with Engine.from_pretrained(
        smollm2_path, engine_config(block_size=16, num_gpu_blocks=256, max_prefill_token_num=32)
    ) as engine:
        got = run_threads(engine, prompts, cfg, stagger_s=0.0)
    model = load_hf(smollm2_path, torch.float32, device)
    try:
        for ids, r in zip(prompts, got):
            with torch.inference_mode():
                out = model(torch.tensor([ids], device=device), output_hidden_states=True)
            lp = out.logits[0].float().log_softmax(-1).cpu()
            for i in range(1, len(ids)):
                assert (
                    abs(r.prompt_logprobs[i][ids[i]] - lp[i - 1, ids[i]].item()) < FP32_LOGPROB_TOL
                )
            for layer in (LAYER, 30):
                want = out.hidden_states[layer][0].float().cpu()
                torch.testing.assert_close(r.hidden_states[layer], want, rtol=1e-3, atol=1e-2)
    finally:
        del model
        release_device_memory()


def test_steering_matches_a_transformers_hook(smollm2_path, prompts, device):
    vector = torch.randn(576, generator=torch.Generator().manual_seed(0))
    steer = {LAYER: SteeringVector(vector, scale=2.0)}
    configs = [
        GenerationConfig(
            max_new_tokens=NEW_TOKENS, logprobs=1, steering=steer if i % 2 == 0 else None
        )
        for i in range(len(prompts))
    ]
    with Engine.from_pretrained(smollm2_path, engine_config(num_gpu_blocks=256)) as engine:
        got = run_threads(engine, prompts, configs, stagger_s=0.0)
    model = load_hf(smollm2_path, torch.float32, device)
    added = (vector * 2.0).to(device)
    try:
        plain = hf_greedy_reference(model, prompts, NEW_TOKENS)
        handle = model.model.layers[LAYER - 1].register_forward_hook(
            lambda module, args, output: output + added
        )
        try:
            steered = hf_greedy_reference(model, prompts, NEW_TOKENS)
        finally:
            handle.remove()
        refs = [steered[i] if i % 2 == 0 else plain[i] for i in range(len(prompts))]
        check_greedy_against(got, refs, FP32_TIE_MARGIN, FP32_LOGPROB_TOL, min_matched=0.9)
        assert any(steered[i].token_ids != plain[i].token_ids for i in range(0, len(prompts), 2))
    finally:
        del model
        release_device_memory()
