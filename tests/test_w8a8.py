"""W8A8 SmoothQuant end to end on a tiny random Llama: the `lmengine quantize w8a8` command,
the checkpoint format, loading with no flag, generation against an independent fake-quant
reference in plain transformers, on-the-fly quantization, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmengine import Engine, EngineConfig, GenerationConfig, pipeline
from lmengine.cli import main
from lmengine.kernels.w8a8 import per_token_quant_ref
from lmengine.models.w8a8 import W8A8Linear, W8A8RMSNorm
from lmengine.quant.w8a8 import QUANT_METHOD, get_layout, linear_weight_bytes
from tests.engine_utils import random_prompts

NEW_TOKENS = 8


def test_checkpoint_records_quantization(tiny_w8a8_path):
    config = json.loads((Path(tiny_w8a8_path) / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == QUANT_METHOD
    assert qc["smoothquant_alpha"] == 0.5 and qc["calib_samples"] == 4
    state = load_file(str(Path(tiny_w8a8_path) / "model.safetensors"))
    assert state["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.int8
    assert state["model.layers.1.mlp.down_proj.weight"].dtype == torch.int8
    assert state["model.layers.0.mlp.gate_up_proj.weight_scale"].dtype == torch.float32
    # the head is stored float (or tied to the embeddings) and quantized when loaded
    assert state.get("lm_head.weight", state["model.embed_tokens.weight"]).dtype == torch.float32
    assert qc["lm_head"] == "int8" and "lm_head" not in qc["not_quantized"]


def test_lm_head_int8_by_default_float_on_request(tiny_w8a8_path, tiny_llama_path, tmp_path):
    from lmengine.models.layers import PackedLinear

    config = EngineConfig(num_gpu_blocks=8, dtype="float32")
    with Engine.from_pretrained(tiny_w8a8_path, config) as engine:
        model = engine.model_agent.model
        assert isinstance(model.lm_head, W8A8Linear)
        assert model.lm_head.weight.shape == model.model.embed_tokens.weight.shape
        assert model.model.embed_tokens.weight.dtype == torch.float32  # lookups stay float
    out = tmp_path / "float_head"
    argv = ["quantize", "w8a8", tiny_llama_path, "--out", str(out), "--float-lm-head"]
    assert main(argv + ["--calib-samples", "2", "--calib-seqlen", "16", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["lm_head"] == (
        "float"
    )
    with Engine.from_pretrained(str(out), EngineConfig(num_gpu_blocks=8)) as engine:
        assert isinstance(engine.model_agent.model.lm_head, PackedLinear)


def _fake_quant_reference(float_path: str, quant_path: str):
    """Plain transformers Llama computing W8A8 in float: weights dequantized from the
    checkpoint, every linear input quantized and dequantized per token by a hook."""
    state = load_file(str(Path(quant_path) / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.float32).eval()

    def fake_quant(_module, args):
        x = args[0]
        q, scale = per_token_quant_ref(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale).view_as(x),)

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."

            def dequant(name: str) -> torch.Tensor:
                w = state[prefix + name + ".weight"].float()
                return w * state[prefix + name + ".weight_scale"][:, None]

            attn, mlp = layer.self_attn, layer.mlp
            parts = dequant("self_attn.qkv_proj").split(
                [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
            )
            for lin, w in zip((attn.q_proj, attn.k_proj, attn.v_proj), parts):
                lin.weight.copy_(w)
            gate, up = dequant("mlp.gate_up_proj").split(mlp.gate_proj.out_features)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            attn.o_proj.weight.copy_(dequant("self_attn.o_proj"))
            mlp.down_proj.weight.copy_(dequant("mlp.down_proj"))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, norm).weight.copy_(state[prefix + norm + ".weight"])
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                lin.register_forward_pre_hook(fake_quant)
            for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                lin.register_forward_pre_hook(fake_quant)
        qc = json.loads((Path(quant_path) / "config.json").read_text())["quantization_config"]
        if qc.get("lm_head") == "int8":  # per vocabulary row, from the float head
            w = model.lm_head.weight.detach()
            amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8)
            deq = torch.round(w * (127 / amax)).clamp(-127, 127) * (amax / 127)
            model.lm_head.weight = torch.nn.Parameter(deq)  # NOTE: unties the embeddings
            model.lm_head.register_forward_pre_hook(fake_quant)
    return model


def test_roundtrip_generates_like_fake_quant_reference(tiny_w8a8_path, tiny_llama_path):
    """Quantize (fixture), save, load with no flag, generate: token for token what the
    fake-quant float reference generates (the int8 path computes exactly the W8A8 math)."""
    prompts = random_prompts([5, 23], vocab=1000, seed=3)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    config = EngineConfig(block_size=4, dtype="float32")  # bfloat16: tests/test_w8a8_bf16.py
    with Engine.from_pretrained(tiny_w8a8_path, config) as engine:
        model = engine.model_agent.model
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, W8A8Linear)
        assert isinstance(layer.mlp.down_proj, W8A8Linear)
        assert isinstance(layer.input_layernorm, W8A8RMSNorm)
        assert not isinstance(model.model.norm, W8A8RMSNorm)  # the final norm feeds lm_head
        inst = engine.create_instance()
        outs = [inst.infer(i, ids, gen_config=gen).token_ids for i, ids in enumerate(prompts)]
        engine.check_integrity()
    reference = _fake_quant_reference(tiny_llama_path, tiny_w8a8_path)
    with torch.inference_mode():
        for ids, out in zip(prompts, outs):
            ref = reference.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
            )
            assert out == ref[0, len(ids) :].tolist()


def test_pipeline_loads_quantized_and_explicit_policy(tiny_w8a8_path):
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with pipeline(tiny_w8a8_path, EngineConfig(quant_policy="w8a8")) as pipe:
        out = pipe(["hello"], gen_config=gen)[0]
    assert out.finish_reason == "length" and out.generate_token_len == 4


def test_quant_policy_on_float_checkpoint_quantizes_without_smoothing(tiny_llama_path):
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with Engine.from_pretrained(tiny_llama_path, EngineConfig(quant_policy="w8a8")) as engine:
        model = engine.model_agent.model
        assert isinstance(model.model.layers[1].self_attn.o_proj, W8A8Linear)
        out = engine.create_instance().infer(0, [1, 2, 3], gen_config=gen)
        assert out.generate_token_len == 4
        quant_bytes = engine.call(lambda: linear_weight_bytes(model))
    with Engine.from_pretrained(tiny_llama_path, EngineConfig()) as engine:
        model = engine.model_agent.model
        float_bytes = engine.call(lambda: linear_weight_bytes(model))
    # int8 weights + a float32 scale per output row: ~1/4 of float32
    assert quant_bytes < 0.3 * float_bytes


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(adapters={"a": "/nowhere"}), "LoRA"),
    ],
)
def test_unsupported_combinations_fail_at_build(tiny_w8a8_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(tiny_w8a8_path, EngineConfig(num_gpu_blocks=8, **overrides))


def test_unsupported_architecture_lists_supported(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        get_layout(model)
    model.save_pretrained(tmp_path / "gpt2")
    assert main(["quantize", "w8a8", str(tmp_path / "gpt2"), "--out", str(tmp_path / "q")]) == 2
    assert "supported: LlamaForCausalLM" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_calibration_corpus_is_offline_and_fixed():
    from lmengine.quant.calibration import stdlib_docstrings

    text = stdlib_docstrings(5000)
    assert len(text) == 5000 and text == stdlib_docstrings(5000)


def test_smoothing_keeps_the_float_function(tiny_llama_path):
    """Every fold is exact in float: norm -> q/k/v and gate/up, v -> o (GQA heads share a
    KV head's scales), up -> down; the weights themselves do change."""
    from lmengine.models import patch
    from lmengine.quant.w8a8 import smooth_layer

    def load():
        return patch(AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32))

    model = load()
    layer, ref = model.model.layers[0], load().model.layers[0]
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(0)

    def maxima(n: int) -> torch.Tensor:  # positive, with a few outlier channels
        return torch.rand(n, generator=gen) * torch.where(torch.rand(n, generator=gen) > 0.9, 50, 1)

    prefix = "model.layers.0"
    acts = {
        f"{prefix}.self_attn.q_proj": maxima(cfg.hidden_size),
        f"{prefix}.self_attn.o_proj": maxima(cfg.num_attention_heads * head_dim),
        f"{prefix}.mlp.gate_proj": maxima(cfg.hidden_size),
        f"{prefix}.mlp.down_proj": maxima(cfg.intermediate_size),
    }
    smooth_layer(layer, prefix, get_layout(model), acts, 0.5, head_dim, fold_rows=True)
    x = torch.randn(5, cfg.hidden_size, generator=gen)
    tol = dict(rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert not torch.allclose(layer.input_layernorm.weight, ref.input_layernorm.weight)
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(x))
        qkv_ref = ref.self_attn.qkv_proj(ref.input_layernorm(x))
        q, k, v = layer.self_attn.qkv_proj.split(qkv)
        q_ref, k_ref, v_ref = ref.self_attn.qkv_proj.split(qkv_ref)
        torch.testing.assert_close(q, q_ref, **tol)
        torch.testing.assert_close(k, k_ref, **tol)
        assert not torch.allclose(v, v_ref)  # v carries 1/s, o_proj's columns carry s

        def o_of(attn, v):  # attention output is a per-head mix of v rows: take v itself
            groups = cfg.num_attention_heads // cfg.num_key_value_heads
            heads = v.view(5, -1, head_dim).repeat_interleave(groups, dim=1)  # [5, H, d]
            return attn.o_proj(heads.reshape(5, -1))

        torch.testing.assert_close(o_of(layer.self_attn, v), o_of(ref.self_attn, v_ref), **tol)
        mlp, mlp_ref = layer.mlp, ref.mlp
        torch.testing.assert_close(
            mlp(layer.post_attention_layernorm(x)), mlp_ref(ref.post_attention_layernorm(x)), **tol
        )


def test_quantize_cli_help_and_bad_calib_file(tiny_llama_path, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--out", "--calib-samples", "--calib-seqlen", "--alpha", "--calib-file"):
        assert flag in help_text
    argv = ["quantize", "w8a8", tiny_llama_path, "--out", str(tmp_path / "q")]
    assert main(argv + ["--calib-file", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
