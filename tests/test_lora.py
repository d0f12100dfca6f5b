"""Multi-LoRA serving against peft: three adapters of different ranks and targets plus the base
model in one batch, more adapters than the pool holds, greedy float32 token for token; adding
and removing adapters at run time; clear errors for adapters that do not fit."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.bench.adapters import save_random_lora
from tests.conftest import save_tiny_llama
from tests.engine_utils import random_prompts

ADAPTERS = {
    # name: LoraConfig arguments
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8rs": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "ko16": dict(
        r=16,
        lora_alpha=4,
        target_modules=["k_proj", "o_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"o_proj": 32},
    ),
}
MAX_NEW = 10


def save_adapter(base_path: str, out_dir, seed: int, **lora_args) -> str:
    """A peft LoRA with random B (N(0, 0.1)), saved with save_pretrained."""
    return save_random_lora(base_path, out_dir, seed, std=0.1, **lora_args)


@functools.lru_cache(maxsize=1)
def _peft_model(base_path: str, paths: tuple[tuple[str, str], ...]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    (first_name, first_path), *rest = paths
    model = PeftModel.from_pretrained(base, first_path, adapter_name=first_name)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def peft_greedy(base_path, adapter_paths, prompts, adapters, max_new_tokens=MAX_NEW):
    """Greedy tokens of peft's PeftModel, one prompt at a time with its adapter (None: base)."""
    model = _peft_model(base_path, tuple(sorted(adapter_paths.items())))
    outs = []
    with torch.inference_mode():
        for ids, name in zip(prompts, adapters):
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
            x = torch.tensor([ids])
            if name is None:
                with model.disable_adapter():
                    out = model.generate(input_ids=x, **kwargs)
            else:
                model.set_adapter(name)
                out = model.generate(input_ids=x, **kwargs)
            outs.append(out[0, len(ids) :].tolist())
    return outs


GEN = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("max_cpu_loras", [None, 1])
def test_mixed_batch_more_adapters_than_slots_equals_peft(
    tiny_llama_path, adapter_paths, max_cpu_loras
):
    names = ["qv4", "all8rs", None, "ko16", "all8rs", "qv4", None, "ko16", "ko16", "all8rs"]
    engine = Engine.from_pretrained(
        tiny_llama_path,
        # one slot of rank 16: o_proj holds 16 pages, all8rs needs 8 and ko16 16, so they
        # cannot be resident together: adapters are evicted and loaded again mid-run (and
        # with one host copy, read again from their folders)
        EngineConfig(
            adapters=adapter_paths,
            max_lora_slots=1,
            max_cpu_loras=max_cpu_loras,
            num_gpu_blocks=64,
            block_size=4,
        ),
    )
    try:
        vocab = engine.info.vocab_size
        prompts = random_prompts([5, 9, 3, 12, 7, 4, 8, 6, 11, 2], vocab, seed=3)
        expected = peft_greedy(tiny_llama_path, adapter_paths, prompts, names)
        # the adapters really change the output: otherwise this test would prove nothing
        base = peft_greedy(tiny_llama_path, adapter_paths, prompts, [None] * len(prompts))
        for name, e, b in zip(names, expected, base):
            assert (e != b) == (name is not None)
        from lmengine.api import Pipeline

        pipe = Pipeline(engine)
        outs = pipe(prompts, gen_config=GEN, adapter_name=names)
        assert [o.token_ids for o in outs] == expected
        stats = engine.stats()
        assert stats["num_adapter_evictions"] > 0 and stats["num_adapter_loads"] > 3
        if max_cpu_loras is None:
            assert stats["num_adapter_host_reads"] == 0 and stats["num_host_adapters"] == 3
        else:  # every load after the first of each adapter read its folder again
            assert stats["num_adapter_host_reads"] > 0 and stats["num_host_adapters"] == 1
        assert stats["num_active_adapters"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.check_integrity()
        # unknown adapter: an error for that request only
        bad = pipe([prompts[1], prompts[0]], gen_config=GEN, adapter_name=["nope", "qv4"])
        assert bad[0].finish_reason == "error" and "unknown adapter 'nope'" in bad[0].error
        assert bad[1].token_ids == expected[0]
        engine.check_integrity()
    finally:
        engine.close()


def test_add_and_remove_at_run_time(tiny_llama_path, adapter_paths):
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=64, block_size=4))
    try:
        inst = engine.create_instance()
        prompt = random_prompts([6], engine.info.vocab_size, seed=5)[0]
        r = inst.infer(1, prompt, gen_config=GEN, adapter_name="ko16")
        assert r.finish_reason == "error" and "unknown adapter" in r.error
        engine.add_adapter("ko16", adapter_paths["ko16"])
        assert engine.adapter_names == ["ko16"]
        with pytest.raises(ValueError, match="already loaded"):
            engine.add_adapter("ko16", adapter_paths["ko16"])
        (expected,) = peft_greedy(tiny_llama_path, adapter_paths, [prompt], ["ko16"])
        long_gen = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
        stream = inst.stream_infer(2, prompt, gen_config=long_gen, adapter_name="ko16")
        first = next(stream)
        engine.remove_adapter("ko16")  # the running request finishes with its adapter
        rest = list(stream)
        assert first.token_ids[:1] == expected[:1] and rest[-1].token_ids == expected
        r = inst.infer(3, prompt, gen_config=GEN, adapter_name="ko16")
        assert r.finish_reason == "error" and "unknown adapter" in r.error
        with pytest.raises(ValueError, match="unknown adapter"):
            engine.remove_adapter("ko16")
        stats = engine.stats()
        assert stats["num_active_adapters"] == stats["num_resident_adapters"] == 0
        assert stats["num_free_lora_pages"] == stats["num_lora_pages"]
        engine.check_integrity()
        engine.add_adapter("again", adapter_paths["ko16"])  # a fresh name for the same folder
        assert inst.infer(4, prompt, gen_config=GEN, adapter_name="again").token_ids == expected
        engine.check_integrity()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def mismatched_paths(tiny_llama_path, smollm2_path, tmp_path_factory, adapter_paths):
    root = tmp_path_factory.mktemp("bad_adapters")
    wide = save_tiny_llama(root / "wide_base", smollm2_path, hidden_size=96)
    paths = {"wide": save_adapter(wide, root / "wide", seed=0, r=4, target_modules=["q_proj"])}
    paths["lm_head"] = save_adapter(
        tiny_llama_path, root / "head", seed=0, r=4, target_modules=["q_proj", "lm_head"]
    )
    dora = root / "dora"
    dora.mkdir()
    config = json.loads((root / "head" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    paths["dora"] = str(dora)
    paths["empty"] = str(root)
    return paths


@pytest.mark.parametrize(
    "name,message",
    [
        ("wide", r"lora_A of model.layers.0.self_attn.q_proj is \[4, 96\] but the base model's"),
        ("lm_head", "module 'lm_head' is not a LoRA-able linear"),
        ("dora", "not supported: use_dora"),
        ("empty", "no adapter_config.json"),
    ],
)
def test_adapter_that_does_not_fit_is_refused_at_add(
    tiny_llama_path, mismatched_paths, name, message
):
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=16))
    try:
        with pytest.raises(ValueError, match=message):
            engine.add_adapter(name, mismatched_paths[name])
        assert engine.adapter_names == []
        ok = engine.create_instance().infer(1, [5, 6, 7], gen_config=GEN)
        assert ok.finish_reason == "length"
    finally:
        engine.close()
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(
            tiny_llama_path,
            EngineConfig(num_gpu_blocks=16, adapters={name: mismatched_paths[name]}),
        )


def test_lora_with_w8a8_or_tp_is_a_clear_error(tiny_llama_path, adapter_paths):
    cfg = EngineConfig(num_gpu_blocks=16, adapters=adapter_paths, quant_policy="w8a8")
    with pytest.raises(ValueError, match="w8a8") as err:
        Engine.from_pretrained(tiny_llama_path, cfg)
    assert "LoRA" in str(err.value)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "glm4"])
def test_lora_on_newer_architectures_equals_peft(arch, tmp_path, smollm2_path):
    """Adapters on the attention and dense MLP linears of Gemma 3 (per-head q/k norms, local
    and global layers), Qwen3-MoE (attention, the dense layer's MLP; the experts are not
    nn.Linears) and GLM-4 (gate/up fused in the checkpoint), mixed with the base model."""
    from tests.test_models_parity import save_tiny_model

    base_path = save_tiny_model(tmp_path / arch, smollm2_path, arch)
    mlp = ["gate_up_proj", "down_proj"] if arch == "glm4" else ["gate_proj", "up_proj", "down_proj"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if arch != "qwen3_moe":
        # NOTE: peft turns Qwen3-MoE's MLP names into LoRA on the experts' 3-D parameters
        # (`target_parameters`), which lmengine refuses by name (below)
        targets += mlp
    adapters = {
        "attn": save_adapter(
            base_path, tmp_path / "attn", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        ),
        "all": save_adapter(
            base_path,
            tmp_path / "all",
            2,
            r=8,
            lora_alpha=16,
            target_modules=targets,
        ),
    }
    names = ["attn", None, "all", "all", "attn"]
    with Engine.from_pretrained(
        base_path, EngineConfig(adapters=adapters, num_gpu_blocks=64, block_size=4)
    ) as engine:
        prompts = random_prompts([5, 17, 3, 12, 9], engine.info.vocab_size, seed=4)
        expected = peft_greedy(base_path, adapters, prompts, names)
        base = peft_greedy(base_path, adapters, prompts, [None] * len(prompts))
        for name, e, b in zip(names, expected, base):
            assert (e != b) == (name is not None)
        from lmengine.api import Pipeline

        outs = Pipeline(engine)(prompts, gen_config=GEN, adapter_name=names)
        assert [o.token_ids for o in outs] == expected
        if arch == "qwen3_moe":
            experts = save_adapter(base_path, tmp_path / "experts", 3, r=4, target_modules=mlp)
            with pytest.raises(ValueError, match="'model.layers.1.mlp.experts' is not a LoRA"):
                engine.add_adapter("experts", experts)
        engine.check_integrity()
