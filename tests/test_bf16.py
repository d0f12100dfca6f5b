"""bfloat16 on the CPU: greedy output follows transformers' bfloat16 `generate` under the
near-tie rule of docs/gpu.md (lead at most 0.5 at the first difference, at least half of the
reference tokens matched, matched log-probabilities within 0.5), on SmolLM2 and on a tiny
model of every architecture; the compiled bfloat16 paths really run; `dtype="auto"` picks
bfloat16 only where the CPU has bfloat16 matrix units, and without them stays float32 and
token for token."""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine import loader
from lmengine.kernels import cpu_ext, cpu_features
from tests.engine_utils import random_prompts, run_threads, spy_compiled_ops
from tests.gpu.common import (
    BF16_LOGPROB_TOL,
    BF16_TIE_MARGIN,
    chat_prompts,
    check_greedy_against,
    hf_greedy_reference,
    load_hf,
)
from tests.hf_reference import hf_greedy
from tests.test_models_parity import ARCHITECTURES, LENGTHS, save_tiny_model

NEW_TOKENS = 24


def bf16_config(**fields) -> EngineConfig:
    return EngineConfig(dtype="bfloat16", device="cpu", **fields)


@pytest.fixture(scope="module")
def smol_case(smollm2_path):
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2_path), 6)
    model = load_hf(smollm2_path, torch.bfloat16, torch.device("cpu"))
    return prompts, hf_greedy_reference(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize(
    "fields",
    [
        dict(block_size=16, num_gpu_blocks=512),
        dict(block_size=4, num_gpu_blocks=60),  # preemption
        dict(block_size=16, num_gpu_blocks=512, max_prefill_token_num=24),  # chunked prompts
    ],
    ids=["batch", "preempt", "chunked"],
)
def test_smollm2_bfloat16_follows_transformers(smollm2_path, smol_case, fields):
    prompts, reference = smol_case
    with Engine.from_pretrained(smollm2_path, bf16_config(**fields)) as engine:
        agent = engine.model_agent
        assert next(agent.model.parameters()).dtype == torch.bfloat16
        assert all(t.dtype == torch.bfloat16 for t in agent.cache_engine.kv_caches[0])
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, logprobs=1)
        got = run_threads(engine, prompts, gen, together=fields["block_size"] == 4)
        check_greedy_against(got, reference, BF16_TIE_MARGIN, BF16_LOGPROB_TOL, 0.5)
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.check_integrity()


# architectures whose tiny random model leaves float32's greedy path within a few bfloat16
# tokens in transformers itself, so that two correct bfloat16 implementations part at more
# than a near tie: checked by their logits' distance from float32 instead (below)
FAR_FROM_FLOAT32_IN_BF16 = {"gpt_oss"}


@pytest.fixture(scope="module", params=sorted(set(ARCHITECTURES) - FAR_FROM_FLOAT32_IN_BF16))
def bf16_arch_case(request, tmp_path_factory, smollm2_path):
    from transformers import AutoConfig

    name = request.param
    path = save_tiny_model(tmp_path_factory.mktemp(f"bf16_{name}"), smollm2_path, name)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = random_prompts(LENGTHS, vocab, seed=2)
    model = load_hf(path, torch.bfloat16, torch.device("cpu"))
    return name, path, prompts, hf_greedy_reference(model, prompts, 12)


def test_every_architecture_in_bfloat16(bf16_arch_case):
    name, path, prompts, reference = bf16_arch_case
    with Engine.from_pretrained(path, bf16_config(block_size=4, num_gpu_blocks=256)) as engine:
        assert next(engine.model_agent.model.parameters()).dtype == torch.bfloat16
        gen = GenerationConfig(max_new_tokens=12, logprobs=1)
        got = run_threads(engine, prompts, gen)
        check_greedy_against(got, reference, BF16_TIE_MARGIN, BF16_LOGPROB_TOL, 0.5)
        engine.check_integrity()


@pytest.mark.parametrize("name", sorted(FAR_FROM_FLOAT32_IN_BF16))
def test_bfloat16_logits_are_as_close_to_float32_as_transformers(name, tmp_path, smollm2_path):
    """gpt-oss's tiny model in bfloat16: transformers' own greedy output leaves its float32
    output at the 7th token of one prompt, and lmengine's and transformers' bfloat16 outputs
    part a few tokens later by rounding alone (each layer's output within ~2 bfloat16 ulps of
    the other's). So: every position's logits of lmengine in bfloat16 (one packed prefill
    through the patched model: sinks, windows, experts in bfloat16) are no farther from the
    float32 logits than transformers' bfloat16 logits are."""
    from transformers import AutoModelForCausalLM

    from lmengine.models import patch
    from tests.test_models_parity import patched_logits

    path = save_tiny_model(tmp_path / name, smollm2_path, name)
    prompts = random_prompts(
        [33, 40, 17], AutoModelForCausalLM.from_pretrained(path).config.vocab_size, 2
    )

    def hf_logits(dtype):
        model = load_hf(path, dtype, torch.device("cpu"))
        with torch.inference_mode():
            return torch.cat([model(torch.tensor([p])).logits[0].float() for p in prompts])

    exact, theirs = hf_logits(torch.float32), hf_logits(torch.bfloat16)
    ours = patched_logits(
        patch(load_hf(path, torch.bfloat16, torch.device("cpu"))), prompts, dtype=torch.bfloat16
    )
    their_error = (theirs - exact).abs().mean()
    our_error = (ours.float() - exact).abs().mean()
    assert our_error <= 1.5 * their_error, (float(our_error), float(their_error))


def test_the_compiled_bfloat16_paths_run(smollm2_path, monkeypatch):
    """A bfloat16 step goes through the compiled GEMV, RMSNorm, SwiGLU, rotary + cache write,
    decode attention and (with AMX / AVX512-BF16) prefill attention, not through torch's eager
    fallbacks. The modules' path: the compiled decode loop calls the same kernels natively
    (tests/test_decode_loop.py)."""
    monkeypatch.setenv("LMENGINE_DECODE_LOOP", "0")
    module = cpu_ext.load()
    assert module is not None, "the CPU kernels failed to build"
    names = [
        "bf16_rms_norm",
        "bf16_silu_mul",
        "rotary_fill_kv_bf16",
        "paged_decode_attention_bf16",
    ]
    if module.bf16_gemv_available():
        names.append("bf16_gemv")
    if module.prefill_attention_available() and cpu_features.has_bf16_units():
        names.append("paged_prefill_attention_bf16")
    with Engine.from_pretrained(smollm2_path, bf16_config(num_gpu_blocks=128)) as engine:
        calls = spy_compiled_ops(monkeypatch, names)
        inst = engine.create_instance()
        out = inst.infer(1, [1, 2, 3, 4, 5], gen_config=GenerationConfig(max_new_tokens=4))
        assert out.finish_reason == "length"
    assert sorted(calls) == sorted(names), f"compiled bfloat16 ops that ran: {sorted(calls)}"


class TestAutoDtype:
    @pytest.fixture(autouse=True)
    def _no_override(self, monkeypatch):
        monkeypatch.delenv("LMENGINE_CPU_DTYPE", raising=False)

    def test_bfloat16_where_the_cpu_has_bf16_units(self, monkeypatch):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
        assert loader.pick_dtype("auto", torch.device("cpu"), None) == torch.bfloat16
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
        assert loader.pick_dtype("auto", torch.device("cpu"), None) == torch.bfloat16

    def test_float32_elsewhere(self, monkeypatch):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
        assert loader.pick_dtype("auto", torch.device("cpu"), None) == torch.float32
        # an explicit dtype is kept whatever the CPU
        assert loader.pick_dtype("bfloat16", torch.device("cpu"), None) == torch.bfloat16

    def test_float32_for_gguf_blocks_and_for_w8a8_without_int8_units(self, monkeypatch):
        """GGUF-block kernels compute in float32: "auto" keeps it for them. A w8a8 model takes
        bfloat16 only where the CPU also has int8 units (tests/test_w8a8_bf16.py)."""
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"amx_bf16"}))
        cpu = torch.device("cpu")
        for policy in ("w8a8", "gguf"):
            assert loader.pick_dtype("auto", cpu, None, policy) == torch.float32
        assert loader.pick_dtype("auto", cpu, None, "float") == torch.bfloat16

        class QuantizedConfig:
            quantization_config = {"quant_method": "w8a8"}  # not lmengine's

        assert loader.pick_dtype("auto", cpu, QuantizedConfig()) == torch.float32

    def test_the_environment_overrides(self, monkeypatch):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"amx_bf16"}))
        monkeypatch.setenv("LMENGINE_CPU_DTYPE", "float32")
        assert loader.pick_dtype("auto", torch.device("cpu"), None) == torch.float32
        monkeypatch.setenv("LMENGINE_CPU_DTYPE", "float64")
        with pytest.raises(ValueError, match="LMENGINE_CPU_DTYPE"):
            loader.pick_dtype("auto", torch.device("cpu"), None)

    def test_without_bf16_units_auto_stays_float32_and_exact(self, monkeypatch, tiny_llama_path):
        """A CPU without AMX or AVX512-BF16 (the probe mocked): 'auto' computes in float32 and
        gives transformers' float32 tokens exactly."""
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(tiny_llama_path).vocab_size
        prompts = random_prompts([3, 17, 30], vocab, seed=5)
        expected = hf_greedy(tiny_llama_path, prompts, 10)
        with Engine.from_pretrained(tiny_llama_path, EngineConfig(device="cpu")) as engine:
            assert next(engine.model_agent.model.parameters()).dtype == torch.float32
            got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=10))
        assert [r.token_ids for r in got] == expected

    def test_with_bf16_units_auto_runs_bfloat16(self, monkeypatch, tiny_llama_path):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"amx_bf16"}))
        with Engine.from_pretrained(tiny_llama_path, EngineConfig(device="cpu")) as engine:
            assert next(engine.model_agent.model.parameters()).dtype == torch.bfloat16
            out = engine.create_instance().infer(
                1, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=3)
            )
            assert out.finish_reason == "length"


def test_tensor_parallel_in_bfloat16(tiny_llama_path):
    """tp=2 on the CPU in bfloat16 (what "auto" gives on an AMX machine): the ranks' partial
    sums are reduced over gloo in bfloat16, so greedy output follows transformers' bfloat16
    under the near-tie rule rather than token for token."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_path).vocab_size
    prompts = random_prompts([3, 17, 30, 9], vocab, seed=7)
    model = load_hf(tiny_llama_path, torch.bfloat16, torch.device("cpu"))
    reference = hf_greedy_reference(model, prompts, 10)
    with Engine.from_pretrained(tiny_llama_path, bf16_config(tp=2, num_gpu_blocks=64)) as engine:
        got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=10, logprobs=1))
        check_greedy_against(got, reference, BF16_TIE_MARGIN, BF16_LOGPROB_TOL, 0.5)
        engine.check_integrity()
