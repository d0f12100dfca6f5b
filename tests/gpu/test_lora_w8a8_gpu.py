"""S-LoRA and W8A8 served through their Triton kernels.

S-LoRA: adapters of different ranks and targets, more than the pool holds, and the base model
in one batch equal each adapter merged into its base by peft (`merge_and_unload`), greedy
float32 on the same device: on the tiny random Llama of the CPU tests and on SmolLM2.
W8A8: a checkpoint made by `lmengine quantize w8a8` generates on the device what an
independent fake-quant transformers model generates there, and SmolLM2 with SmoothQuant keeps
its held-out perplexity within 3 % of the float model's (the CPU tests' bound).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmengine import Engine, GenerationConfig
from lmengine.api import Pipeline
from tests.engine_utils import random_prompts, run_threads
from tests.gpu.common import (
    FP32_LOGPROB_TOL,
    FP32_TIE_MARGIN,
    by_mode,
    chat_prompts,
    check_greedy_against,
    engine_config,
    hf_greedy_reference,
    release_device_memory,
)
from tests.test_lora import ADAPTERS, save_adapter
from tests.test_w8a8 import _fake_quant_reference

pytestmark = pytest.mark.gpu

LORA_NEW_TOKENS = by_mode(gpu=24, cpu=10)


def merged_reference(base_path: str, adapter_path: str | None, prompts, device, **gen):
    """Greedy tokens and logits of `base_path` with the adapter merged into its weights by
    peft (None: the base model), float32 on `device`."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path).merge_and_unload()
    model = model.to(device).eval()
    try:
        return hf_greedy_reference(model, prompts, LORA_NEW_TOKENS, **gen)
    finally:
        del model
        release_device_memory()


def check_lora_batch(engine, base_path, adapter_paths, prompts, names, device, **gen) -> None:
    """The engine's outputs for `prompts` with adapters `names` (None: base) follow the
    merged references (near-tie rule of float32), and each adapter changes its outputs."""
    refs: list = [None] * len(prompts)
    for name in set(names):
        rows = [i for i, n in enumerate(names) if n == name]
        path = None if name is None else adapter_paths[name]
        batch = [prompts[i] for i in rows]
        for i, ref in zip(rows, merged_reference(base_path, path, batch, device, **gen)):
            refs[i] = ref
    base = merged_reference(base_path, None, prompts, device, **gen)
    for name, ref, b in zip(names, refs, base):  # the adapters really change the output
        assert (ref.token_ids != b.token_ids) == (name is not None)
    gen_config = GenerationConfig(max_new_tokens=LORA_NEW_TOKENS, logprobs=1, **gen)
    outs = Pipeline(engine)(prompts, gen_config=gen_config, adapter_name=names)
    check_greedy_against(outs, refs, FP32_TIE_MARGIN, FP32_LOGPROB_TOL, 0.9)


def test_slora_tiny_llama_equals_merged_peft(tiny_llama_path, adapter_paths, device, triton_spy):
    names = ["qv4", "all8rs", None, "ko16", "all8rs", "qv4", None, "ko16", "ko16", "all8rs"]
    # one slot of rank 16: the adapters cannot be resident together and are paged in and out
    cfg = engine_config(
        dtype="float32", adapters=adapter_paths, max_lora_slots=1, num_gpu_blocks=64
    )
    with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
        prompts = random_prompts([5, 9, 3, 12, 7, 40, 8, 6, 11, 2], engine.info.vocab_size, 3)
        check_lora_batch(
            engine, tiny_llama_path, adapter_paths, prompts, names, device, ignore_eos=True
        )
        stats = engine.stats()
        assert stats["num_adapter_evictions"] > 0 and stats["num_adapter_loads"] > 3
        assert stats["num_active_adapters"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.check_integrity()
    triton_spy.assert_ran("lora_add_triton")


def test_slora_smollm2_equals_merged_peft(smollm2_path, tmp_path, device, triton_spy):
    specs = {
        "all16": dict(r=16, lora_alpha=16, target_modules=ADAPTERS["all8rs"]["target_modules"]),
        "qv8": dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    }
    adapters = {
        name: save_adapter(smollm2_path, tmp_path / name, seed=i, **args)
        for i, (name, args) in enumerate(specs.items())
    }
    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_path), by_mode(gpu=9, cpu=4))
    names = (["all16", None, "qv8"] * 3)[: len(prompts)]
    cfg = engine_config(dtype="float32", adapters=adapters, max_lora_slots=2, num_gpu_blocks=256)
    with Engine.from_pretrained(smollm2_path, cfg) as engine:
        check_lora_batch(engine, smollm2_path, adapters, prompts, names, device)
        engine.check_integrity()
    triton_spy.assert_ran("lora_add_triton", "paged_attention_triton")


# ---- W8A8 ---------------------------------------------------------------------------------------


W8A8_KERNELS = ("per_token_quant_triton", "rms_norm_quant_triton", "int8_gemm_triton")


def test_w8a8_generates_like_fake_quant_reference(
    tiny_w8a8_path, tiny_llama_path, device, triton_spy
):
    """Token for token what a plain transformers Llama computing W8A8 in float (weights
    dequantized from the checkpoint, every linear input quantized per token) generates."""
    from lmengine.models.w8a8 import W8A8Linear

    prompts = random_prompts([5, 23, 40, 1, 17, 64], vocab=1000, seed=3)
    new_tokens = by_mode(gpu=16, cpu=8)
    gen = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, logprobs=1)
    with Engine.from_pretrained(tiny_w8a8_path, engine_config(dtype="float32")) as engine:
        qkv = engine.model_agent.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, W8A8Linear)
        assert qkv.weight.dtype == torch.int8 and qkv.weight.device.type == device.type
        got = run_threads(engine, prompts, gen)
        engine.check_integrity()
    model = _fake_quant_reference(tiny_llama_path, tiny_w8a8_path).to(device)
    refs = hf_greedy_reference(model, prompts, new_tokens, ignore_eos=True)
    del model
    # NOTE: the int8 GEMM is exact and both sides quantize with the same formula, so the
    # float32 rules apply; a value on a rounding boundary may land one int8 step away
    check_greedy_against(got, refs, FP32_TIE_MARGIN, 1e-2, 0.9)
    triton_spy.assert_ran(*W8A8_KERNELS)


@pytest.fixture(scope="module")
def smol_smoothquant_path(smollm2_path, tmp_path_factory) -> str:
    """SmolLM2 with SmoothQuant, calibrated on 4 x 64 tokens (as tests/test_w8a8_smollm2.py)."""
    from lmengine.engine.loader import load_model_and_tokenizer
    from lmengine.quant.w8a8 import calibrate, quantize_checkpoint

    model, tokenizer, _, _ = load_model_and_tokenizer(smollm2_path, "float32", "cpu")
    maxima = calibrate(model, tokenizer, 4, 64, show_progress=False)
    del model
    out = tmp_path_factory.mktemp("gpu_smol_w8a8") / "sq"
    path = quantize_checkpoint(smollm2_path, out, alpha=0.5, act_maxima=maxima, show_progress=False)
    return str(path)


@pytest.mark.parametrize("dtype", by_mode(gpu=["float32", "bfloat16"], cpu=["float32"]))
def test_w8a8_smollm2_perplexity_within_3_percent(
    smollm2_path, smol_smoothquant_path, dtype, triton_spy
):
    from lmengine.quant.eval import heldout_token_ids, perplexity

    window, num_windows = 128, 8
    ppl = {}
    for name, path in (("float", smollm2_path), ("smoothquant", smol_smoothquant_path)):
        cfg = engine_config(dtype=dtype, num_gpu_blocks=num_windows * window // 16 + 8)
        with Engine.from_pretrained(path, cfg) as engine:
            ids = heldout_token_ids(engine.tokenizer)
            ppl[name] = perplexity(engine, ids, window, num_windows)
    assert 1.0 < ppl["float"] < 100.0, ppl  # SmolLM2 reads the held-out text well
    assert ppl["smoothquant"] <= 1.03 * ppl["float"], ppl
    triton_spy.assert_ran(*W8A8_KERNELS)
