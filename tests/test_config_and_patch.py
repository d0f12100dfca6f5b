from __future__ import annotations

import pytest
import torch

from lmengine import EngineConfig, GenerationConfig
from lmengine.models import MODULE_MAP, patch, supported_architectures


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(block_size=0), "block_size must be >= 1, got 0"),
        (dict(eviction_type="drop"), "eviction_type"),
        (dict(cache_max_entry_count=1.5), "cache_max_entry_count"),
        (dict(max_batch_size="8"), "max_batch_size must be an integer"),
        (dict(quant_policy="int4"), "quant_policy"),
        (dict(max_cpu_loras=0), "max_cpu_loras must be >= 1, got 0"),
    ],
)
def test_engine_config_errors_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
        (dict(top_p=0.0), "top_p must be > 0"),
        (dict(top_k=-1), "top_k"),
        (dict(temperature=0), "temperature must be > 0"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_new_tokens=9, max_new_tokens=3), "min_new_tokens"),
        (dict(stop_words=[""]), "stop_words"),
        (dict(logprobs=50), "logprobs must be <= 20"),
        (dict(random_seed=-3), "random_seed"),
    ],
)
def test_generation_config_errors_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        GenerationConfig(**kwargs)


def test_unscheduled_policy_name_is_rejected_at_engine_build(tiny_llama_path):
    from lmengine import Engine

    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        Engine.from_pretrained(tiny_llama_path, EngineConfig(scheduling_policy="random"))


def test_patch_swaps_classes_and_keeps_weights(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch(model)
    from lmengine.models.patch import qualname

    names = [qualname(type(m)) for m in model.modules()]
    assert not any(n in MODULE_MAP for n in names), "an HF class named in MODULE_MAP survived"
    assert sum(n in MODULE_MAP.values() for n in names) >= 5
    after = model.state_dict()
    # merged linears hold their parts stacked in order; every other weight is unchanged
    merged = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for key, value in after.items():
        owner, _, param = key.rpartition(".")
        prefix, _, name = owner.rpartition(".")
        if name in merged:
            parts = [before[f"{prefix}.{part}.{param}"] for part in merged[name]]
            assert torch.equal(value, torch.cat(parts)), key
        else:
            assert torch.equal(before[key], value), key


def test_unsupported_architecture_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        patch(model)
    assert "LlamaForCausalLM" in supported_architectures()
    assert all(v.startswith("lmengine.") for v in MODULE_MAP.values())
