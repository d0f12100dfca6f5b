"""HF parity for every architecture in MODULE_MAP: greedy float32 output of the engine equals
transformers `generate`, token for token, on a tiny random model of each architecture saved
with save_pretrained and loaded through the real loading code, with concurrent requests,
chunked prefill, preemption (recompute and swap) and prefix caching. On the architectures of
the 2025-26 wave also speculative decoding, hidden states, steering and a grammar.

Sliding windows (8 keys) are shorter than most prompts, so a kernel that ignored them would
diverge; Gemma 2's soft caps are low enough to bite on these weights.
"""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import random_prompts, run_threads
from tests.hf_reference import hf_greedy

LENGTHS = [1, 5, 17, 33, 3, 40, 9]
NEW_TOKENS = 12
WINDOW = 8

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# name: (config class, model class, config overrides)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # one local (sliding) and one global layer, each on its own rotary base
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=8.0,
        ),
    ),
    # layer 0 dense (mlp_only_layers), layer 1 routed
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    # MLA (q through its low-rank path) over a latent cache; layer 0 dense, layer 1 routed
    # over 8 experts in 4 groups (best 2 groups) plus a shared expert
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=None,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
        ),
    ),
    # attention sinks, a sliding and a full layer, YaRN rotary, biased experts
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        ),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # layer 1 without rotary
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        ),
    ),
    "glm4": (
        "Glm4Config",
        "Glm4ForCausalLM",
        dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(ffn_dim=128, num_key_value_heads=None, intermediate_size=None),
    ),
    # OPT-350m's shape: post-norm, embeddings narrower than the hidden size
    "opt_post_norm": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            ffn_dim=128,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
            num_key_value_heads=None,
            intermediate_size=None,
        ),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(rotary_pct=0.5, num_key_value_heads=None),
    ),
}

ENGINE_CONFIGS = {
    # 52 tokens at most per sequence = 13 blocks: the pool holds about two sequences
    "preempt": dict(block_size=4, num_gpu_blocks=30),
    "chunked": dict(block_size=16, num_gpu_blocks=256, max_prefill_token_num=7),
    # the prompts run twice: the second time their prefixes come from the cache
    "prefix": dict(block_size=4, num_gpu_blocks=256, enable_prefix_caching=True),
    # preempted sequences' blocks go to host memory and come back
    "swap": dict(block_size=4, num_gpu_blocks=30, eviction_type="swap", num_cpu_blocks=400),
}


def save_tiny_model(path, tokenizer_src: str, name: str, seed: int = 0) -> str:
    """A tiny random model of architecture `name` with SmolLM2's tokenizer, saved to `path`."""
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, overrides = ARCHITECTURES[name]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    params = dict(
        _COMMON,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    params.update(overrides)
    params = {k: v for k, v in params.items() if v is not None}
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**params)
    model = getattr(transformers, model_cls)(config)
    # NOTE: default init gives near-uniform logits; scale the matrices up so that greedy
    # choices are decisive, as on a trained model (see tests/conftest.py save_tiny_llama).
    # Norm weights and biases start as constants (ones or zeros): perturb them, or a patch
    # that dropped a bias or swapped two of Gemma 2's norms would go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.endswith("_bias"):  # gpt-oss's [E, out] expert biases
                p.mul_(8.0)
            else:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing correction
                b.add_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_case(request, tmp_path_factory, smollm2_path):
    name = request.param
    path = save_tiny_model(tmp_path_factory.mktemp(name), smollm2_path, name)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = random_prompts(LENGTHS, vocab, seed=2)
    return name, path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("engine_config", sorted(ENGINE_CONFIGS))
def test_architecture_matches_transformers(arch_case, engine_config):
    name, path, prompts, expected = arch_case
    if engine_config == "swap" and name not in NEW_ARCHITECTURES | SWAP_TOO:
        pytest.skip("swap: the new architectures and one of each older kind (suite time)")
    engine = Engine.from_pretrained(path, EngineConfig(**ENGINE_CONFIGS[engine_config]))
    try:
        arch = type(engine.model_agent.model).__name__
        assert arch.startswith("Patched"), f"{name} ran unpatched as {arch}"
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS)
        rounds = 2 if engine_config == "prefix" else 1
        for _ in range(rounds):
            together = engine_config in ("preempt", "swap")
            got = run_threads(engine, prompts, gen, together=together)
            for i, (r, exp) in enumerate(zip(got, expected)):
                assert r.finish_reason in ("stop", "length"), r.error
                assert r.token_ids == exp, f"{name}: prompt {i} ({len(prompts[i])} tokens) differs"
        stats = engine.stats()
        if engine_config in ("preempt", "swap"):
            assert stats["num_preemptions"] > 0, "the tiny pool was meant to force preemption"
        if engine_config == "swap":
            assert stats["num_swap_outs"] > 0, "preempted blocks were meant to be swapped out"
            assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"]
        if engine_config == "prefix":
            assert stats["num_prefix_cached_tokens"] > 0, "the second round was meant to hit"
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.check_integrity()
    finally:
        engine.close()


def patched_logits(
    model, prompts: list[list[int]], block_size: int = 4, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits of every prompt token from one packed prefill of the patched `model`
    (already patched), with a fresh paged cache in `dtype`: [sum(len(p)), vocab]."""
    from lmengine.kernels import AttentionMetadata
    from lmengine.models.context import StepContext, step_context
    from lmengine.models.model_info import ModelInfo

    info = ModelInfo.from_hf(model.config)
    lens = [len(p) for p in prompts]
    tables, next_block = [], 0
    for n in lens:
        num = (n + block_size - 1) // block_size
        tables.append(list(range(next_block, next_block + num)))
        next_block += num
    shape = (next_block, block_size, info.num_kv_heads, info.head_dim)
    if info.latent_dim is None:
        caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(info.num_layers)
        ]
    else:  # a latent cache: v is the first latent_dim dims of k
        keys = [torch.zeros(shape, dtype=dtype) for _ in range(info.num_layers)]
        caches = [(k, k[..., : info.latent_dim]) for k in keys]
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat(
        [
            torch.tensor(t).repeat_interleave(block_size)[:n] * block_size
            + torch.arange(n) % block_size
            for t, n in zip(tables, lens)
        ]
    )
    ctx = StepContext(
        positions=positions,
        slot_mapping=slots,
        attn_meta=AttentionMetadata.build(tables, lens, lens, block_size),
        kv_caches=caches,
        logits_indices=torch.arange(sum(lens)),
    )
    with torch.inference_mode(), step_context(ctx):
        return model(torch.tensor([t for p in prompts for t in p]))


def test_architecture_logits_match_transformers(arch_case):
    """Every position's logits, not just the argmax: catches monotonic slips (a missing final
    soft-cap leaves greedy tokens unchanged but changes sampling)."""
    from transformers import AutoModelForCausalLM

    from lmengine.models import patch

    name, path, prompts, _ = arch_case
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    picked = [prompts[3], prompts[2]]  # 33 and 17 tokens: past the sliding window
    with torch.inference_mode():
        expected = torch.cat([model(torch.tensor([p])).logits[0] for p in picked])
    got = patched_logits(patch(model), picked)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# the older architectures that run under swap preemption too: sliding windows and soft caps,
# MoE, partial rotary, post-norm, parallel attention
SWAP_TOO = {"gemma2", "mixtral", "phi3", "opt_post_norm", "gpt_neox"}
# the architectures of the 2025-26 wave: what else the engine does must keep working on them
NEW_ARCHITECTURES = {"gemma3", "qwen3_moe", "gpt_oss", "deepseek_v3", "olmo2", "smollm3"}
NEW_ARCHITECTURES |= {"granite", "glm4"}


def test_new_architectures_under_speculation_hooks_and_grammars(arch_case):
    """On each new architecture: speculative decoding (drafts verified several tokens at a time
    through windows, sinks and the latent cache, a wrong draft every fourth position) gives
    transformers' greedy tokens; hidden states equal transformers' and a steering vector
    steers as a transformers hook does, next to an unsteered request; a regex holds."""
    import re

    from transformers import AutoConfig

    from lmengine.config import SpeculativeConfig, SteeringVector
    from tests.test_research import check_hidden_states, hf_steered
    from tests.test_speculative import OracleProposer

    name, path, prompts, _ = arch_case
    if name not in NEW_ARCHITECTURES:
        pytest.skip("an architecture of the earlier waves (covered by tests/test_speculative.py)")
    expected = hf_greedy(path, prompts, NEW_TOKENS, ignore_eos=True)
    hidden = AutoConfig.from_pretrained(path).hidden_size
    vector = SteeringVector(torch.randn(hidden, generator=torch.Generator().manual_seed(0)) * 8)
    config = EngineConfig(
        block_size=4,
        num_gpu_blocks=256,
        max_prefill_token_num=16,
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=3),
    )
    with Engine.from_pretrained(path, config) as engine:
        oracle = OracleProposer(prompts, expected, corrupt_every=4)
        engine.call(lambda: setattr(engine.model_agent, "proposer", oracle))
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        got = run_threads(engine, prompts, gen)
        assert [r.token_ids for r in got] == expected, name
        spec = engine.stats()["speculative"]
        assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
        engine.call(lambda: setattr(engine.model_agent, "proposer", None))
        configs = [
            GenerationConfig(max_new_tokens=6, ignore_eos=True, output_hidden_states="all"),
            GenerationConfig(max_new_tokens=6, ignore_eos=True, steering={1: vector}),
            GenerationConfig(max_new_tokens=6, ignore_eos=True),
            GenerationConfig(max_new_tokens=8, structured_outputs={"regex": "(yes|no)[0-9]{2}"}),
        ]
        probe, steered, plain, constrained = run_threads(engine, prompts[3:7], configs)
        engine.check_integrity()
    check_hidden_states(
        path, prompts[3] + probe.token_ids, probe.hidden_states, sorted(probe.hidden_states)
    )
    assert steered.token_ids == hf_steered(path, prompts[4], {1: vector}, 6)
    assert steered.token_ids != expected[4][:6]  # the vector is large enough to steer
    assert plain.token_ids == expected[5][:6]
    assert re.fullmatch("(yes|no)[0-9]{2}", constrained.text), constrained.text
