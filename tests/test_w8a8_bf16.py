"""A w8a8 checkpoint computing in bfloat16 on the CPU: greedy output against a reference of the
same quantized model in plain transformers bfloat16 (every linear an exact int8 GEMM of the
reference kernels), under the near-tie rule of docs/gpu.md; the compiled bfloat16 w8a8 paths
really run; `dtype="auto"` picks bfloat16 for a w8a8 model only where the CPU has bfloat16 and
int8 units, and an explicit `dtype="float32"` keeps the float32 path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.kernels import cpu_ext, cpu_features
from lmengine.kernels.w8a8 import int8_gemm_ref, pack_int8_weight_amx, per_token_quant_ref
from lmengine.models.w8a8 import W8A8Linear, quantize_weight
from tests.engine_utils import random_prompts, run_threads, spy_compiled_ops
from tests.gpu.common import (
    BF16_LOGPROB_TOL,
    BF16_TIE_MARGIN,
    check_greedy_against,
    hf_greedy_reference,
    load_hf,
)

NEW_TOKENS = 12


class ExactInt8Linear(nn.Module):
    """The reference linear: per-token quantization, the int8 product in int64, the float32
    epilogue, rounded to the input's dtype (`int8_gemm_ref`)."""

    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
        super().__init__()
        self.w_q, self.w_scale = w_q, w_scale  # [out, in] int8, [out] float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in]
        out = int8_gemm_ref(*per_token_quant_ref(rows), self.w_q, self.w_scale, None, x.dtype)
        return out.view(*x.shape[:-1], -1)


def _int8_reference(float_path: str, quant_path: str) -> nn.Module:
    """transformers' Llama in bfloat16 with the checkpoint's smoothed norms and every linear
    (and the LM head, quantized per row from its bfloat16 weight as the engine does) an
    ExactInt8Linear of the checkpoint's int8 weights."""
    state = load_file(str(Path(quant_path) / "model.safetensors"))
    model = load_hf(float_path, torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."

            def int8_parts(name: str, sizes: list[int]) -> list[ExactInt8Linear]:
                w = state[prefix + name + ".weight"].split(sizes)
                s = state[prefix + name + ".weight_scale"].split(sizes)
                return [ExactInt8Linear(*pair) for pair in zip(w, s)]

            attn, mlp = layer.self_attn, layer.mlp
            sizes = [attn.q_proj.out_features, attn.k_proj.out_features]
            sizes.append(attn.v_proj.out_features)
            attn.q_proj, attn.k_proj, attn.v_proj = int8_parts("self_attn.qkv_proj", sizes)
            (attn.o_proj,) = int8_parts("self_attn.o_proj", [attn.o_proj.out_features])
            sizes = [mlp.gate_proj.out_features, mlp.up_proj.out_features]
            mlp.gate_proj, mlp.up_proj = int8_parts("mlp.gate_up_proj", sizes)
            (mlp.down_proj,) = int8_parts("mlp.down_proj", [mlp.down_proj.out_features])
            for norm in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, norm).weight.copy_(state[prefix + norm + ".weight"])
        qc = json.loads((Path(quant_path) / "config.json").read_text())["quantization_config"]
        assert qc["lm_head"] == "int8"
        model.lm_head = ExactInt8Linear(*quantize_weight(model.lm_head.weight))
    return model


def test_w8a8_bfloat16_follows_its_int8_reference(tiny_w8a8_path, tiny_llama_path):
    prompts = random_prompts([3, 17, 30, 61], vocab=1000, seed=7)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    config = EngineConfig(dtype="bfloat16", device="cpu", block_size=4, num_gpu_blocks=128)
    with Engine.from_pretrained(tiny_w8a8_path, config) as engine:
        model = engine.model_agent.model
        assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
        assert isinstance(model.lm_head, W8A8Linear)
        assert all(t.dtype == torch.bfloat16 for t in engine.model_agent.cache_engine.kv_caches[0])
        got = run_threads(engine, prompts, gen)
        engine.check_integrity()
    reference = hf_greedy_reference(
        _int8_reference(tiny_llama_path, tiny_w8a8_path), prompts, NEW_TOKENS, ignore_eos=True
    )
    check_greedy_against(got, reference, BF16_TIE_MARGIN, BF16_LOGPROB_TOL, 0.5)


def test_the_compiled_bfloat16_w8a8_paths_run(tiny_w8a8_path, monkeypatch):
    """A bfloat16 w8a8 step goes through the compiled quantizing norm, SwiGLU + quantization,
    int8 GEMMs (on AMX tiles where the CPU has AMX-INT8) and the bfloat16 attention kernels."""
    module = cpu_ext.load()
    assert module is not None, "the CPU kernels failed to build"
    names = ["w8a8_rms_norm_quant", "w8a8_silu_mul", "rotary_fill_kv_bf16"]
    names.append("paged_decode_attention_bf16")
    if pack_int8_weight_amx(torch.zeros(16, 64, dtype=torch.int8)) is not None:
        names.append("w8a8_vnni_linear")  # prompts and decode
    config = EngineConfig(dtype="bfloat16", device="cpu", num_gpu_blocks=64)
    with Engine.from_pretrained(tiny_w8a8_path, config) as engine:
        calls = spy_compiled_ops(monkeypatch, names)
        out = engine.create_instance().infer(
            1, list(range(5, 30)), gen_config=GenerationConfig(max_new_tokens=3)
        )
        assert out.finish_reason == "length"
    assert sorted(calls) == sorted(names), f"compiled ops that ran: {sorted(calls)}"
    dtypes = {out.dtype for out in calls.get("w8a8_vnni_linear", [])}
    assert dtypes <= {torch.bfloat16}


class TestAutoDtypeW8A8:
    @pytest.fixture(autouse=True)
    def _no_override(self, monkeypatch):
        monkeypatch.delenv("LMENGINE_CPU_DTYPE", raising=False)

    @pytest.mark.parametrize(
        "flags, expected",
        [
            ({"avx512f", "amx_bf16", "amx_int8"}, torch.bfloat16),
            ({"avx512_bf16", "avx512_vnni"}, torch.bfloat16),  # e.g. AMD Zen 4 / 5
            ({"avx512_bf16"}, torch.float32),  # no int8 dot products
            ({"avx512_vnni"}, torch.float32),  # no bfloat16 units
            ({"avx2", "fma"}, torch.float32),
        ],
    )
    def test_w8a8_models_follow_the_units(self, monkeypatch, flags, expected):
        from lmengine.engine import loader

        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
        cpu = torch.device("cpu")

        class W8A8Config:
            quantization_config = {"quant_method": "lmengine_w8a8"}

        assert loader.pick_dtype("auto", cpu, W8A8Config()) == expected
        assert loader.pick_dtype("auto", cpu, None, "w8a8") == expected
        # an explicit dtype, GGUF blocks and other quantizers are not affected
        assert loader.pick_dtype("float32", cpu, W8A8Config()) == torch.float32
        assert loader.pick_dtype("auto", cpu, None, "gguf") == torch.float32

        class OtherQuantizer:
            quantization_config = {"quant_method": "gptq"}

        assert loader.pick_dtype("auto", cpu, OtherQuantizer()) == torch.float32

    def test_auto_loads_a_w8a8_checkpoint_in_bfloat16_and_float32_stays(
        self, monkeypatch, tiny_w8a8_path
    ):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_int8"}))
        prompt, gen = [5, 6, 7, 8], GenerationConfig(max_new_tokens=4, ignore_eos=True)
        with Engine.from_pretrained(tiny_w8a8_path, EngineConfig(device="cpu")) as engine:
            norm = engine.model_agent.model.model.layers[0].input_layernorm
            assert norm.weight.dtype == torch.bfloat16
            assert engine.create_instance().infer(1, prompt, gen_config=gen).finish_reason
        config = EngineConfig(dtype="float32", device="cpu")
        with Engine.from_pretrained(tiny_w8a8_path, config) as engine:
            model = engine.model_agent.model
            assert model.model.layers[0].input_layernorm.weight.dtype == torch.float32
            assert model.model.embed_tokens.weight.dtype == torch.float32
            got = run_threads(engine, [prompt], gen)
        assert got[0].finish_reason == "length"
