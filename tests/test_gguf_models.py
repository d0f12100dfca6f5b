"""Tiny random Llamas written as GGUF files by the test (Q4_0, Q4_1 and Q8_0 blocks, the
llama.cpp converter's rotary row order, SmolLM2's tokenizer), loaded through the real loading
code: computing on their blocks (quant_policy="gguf") gives the greedy tokens of the float32
model transformers expands the same file to. Then llama.cpp's files of Gemma 3, Qwen3-MoE,
gpt-oss and DeepSeek-V3 (deepseek2, in the forms llama.cpp's converter wrote over time),
expanded bit for bit to the checkpoint they were written from, blocks where read; and the files
nothing reads: other architectures, tensor types, a model left unfilled."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine.gguf_blocks import BLOCK_ARCHITECTURES
from lmengine.engine.gguf_blocks import LLAMA_LINEARS as LAYER_TENSORS
from lmengine.engine.loader import default_gguf_path, resolve_model_path
from tests.conftest import save_tiny_llama
from tests.engine_utils import random_prompts, run_threads
from tests.hf_reference import hf_greedy
from tests.kernels.test_gguf import random_k_blocks
from tests.test_lora import ADAPTERS, peft_greedy, save_adapter

Q = gguf.GGMLQuantizationType

LAYOUTS = {  # block type of each linear, and of the token embedding (tied to the LM head)
    # Q4_0 linears and a Q4_1 embedding (tied LM head); the other layouts hold Q4_1 linears
    # and a Q4_0 head
    "q4": {**dict.fromkeys(LAYER_TENSORS, Q.Q4_0), "token_embd": Q.Q4_1},
    "mixed": {  # the parts of the merged linears (qkv, gate_up) in different types too
        "attn_q": Q.Q4_0,
        "attn_k": Q.Q4_1,
        "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_1,
        "ffn_gate": Q.Q4_1,
        "ffn_up": Q.Q4_0,
        "ffn_down": Q.Q8_0,
        "token_embd": Q.Q8_0,  # as SmolLM2's file has it
    },
    # llama.cpp's K types (256-weight blocks, random: the gguf package cannot quantize to
    # them), mixed as in a Q4_K_M file; on a model 256 wide
    "k-quants": {
        **dict.fromkeys(["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"], Q.Q4_K),
        **dict.fromkeys(["attn_v", "ffn_down", "token_embd"], Q.Q6_K),
    },
    # an LM head of its own (not tied to the embedding), written as the file's output tensor
    "untied-head": {**dict.fromkeys(LAYER_TENSORS, Q.Q4_1), "token_embd": Q.Q8_0, "output": Q.Q4_0},
}


def converter_row_order(w: np.ndarray, num_heads: int) -> np.ndarray:
    """A query / key projection's rows as llama.cpp's converter stores them (its rotary layout:
    each head's two halves interleaved)."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(rows, -1)


@functools.cache
def smollm2_tokenizer_fields() -> list[tuple]:
    """(name, value, type, array item type) of each tokenizer field of lmengine's default GGUF
    file (SmolLM2's), read once: parsing the file takes seconds."""
    fields = []
    for field in gguf.GGUFReader(str(default_gguf_path())).fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            fields.append((field.name, field.contents(), vtype, sub))
    return fields


def add_smollm2_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The tokenizer fields of lmengine's default GGUF file (SmolLM2's), copied into `writer`."""
    for name, value, vtype, sub in smollm2_tokenizer_fields():
        writer.add_key_value(name, value, vtype, sub_type=sub)


def write_llama_gguf(path, hf_folder: str, qtypes: dict) -> str:
    """The transformers Llama in `hf_folder` as a GGUF file at `path`, its linears, embedding
    and (untied) output head quantized by the gguf package as `qtypes` says, its norms float32,
    its tokenizer copied from SmolLM2's file."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_folder)
    state = load_file(f"{hf_folder}/model.safetensors")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    add_smollm2_tokenizer(writer)

    rng = np.random.default_rng(0)

    def add(name: str, weight: torch.Tensor, qtype=None) -> None:
        data = weight.float().numpy()
        if qtype is None:
            writer.add_tensor(name, data)
        elif qtype in (Q.Q4_K, Q.Q6_K):  # random blocks in place of the weight
            blocks = random_k_blocks(qtype.name, *data.shape, rng, scale=0.1)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"], qtypes["token_embd"])
    add("output_norm.weight", state["model.norm.weight"])
    if "output" in qtypes:
        add("output.weight", state["lm_head.weight"], qtypes["output"])
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", state[prefix + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", state[prefix + "post_attention_layernorm.weight"])
        for part, hf_name in LAYER_TENSORS.items():
            weight = state[f"{prefix}{hf_name}.weight"]
            if part in heads:
                weight = torch.from_numpy(converter_row_order(weight.numpy(), heads[part]))
            add(f"blk.{i}.{part}.weight", weight, qtypes[part])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_hf_untied(tmp_path_factory, smollm2_path) -> str:
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny_gguf_untied"), smollm2_path, seed=6, tie_word_embeddings=False
    )


@pytest.fixture(scope="module")
def tiny_hf_256(tmp_path_factory, smollm2_path) -> str:
    """256 wide (the K types' blocks are 256 weights long)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny_gguf_256"),
        smollm2_path,
        seed=7,
        tie_word_embeddings=True,
        hidden_size=256,
        intermediate_size=512,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tiny_gguf_blocks_give_the_expanded_models_greedy_tokens(
    tmp_path, tiny_hf, tiny_hf_untied, tiny_hf_256, layout
):
    hf_folder = tiny_hf_untied if "output" in LAYOUTS[layout] else tiny_hf
    hf_folder = tiny_hf_256 if layout == "k-quants" else hf_folder
    path = write_llama_gguf(tmp_path / f"tiny-{layout}.gguf", hf_folder, LAYOUTS[layout])
    expanded = resolve_model_path(path)  # transformers' float32 expansion of the file
    prompts = random_prompts([1, 6, 19, 40, 71], 49152, seed=len(layout))
    expected = hf_greedy(expanded, prompts, 12)
    assert len({t for tokens in expected for t in tokens}) > 10  # a model that says things
    # a small pool and budget: chunked prompts and preemption, rows through the GEMV (<= 8
    # rows) and the GEMM paths
    cfg = EngineConfig(
        quant_policy="gguf", block_size=4, num_gpu_blocks=40, max_prefill_token_num=24
    )
    with Engine.from_pretrained(path, cfg) as engine:
        kinds = [type(m).__name__ for m in engine.model_agent.runner.model.modules()]
        assert kinds.count("GGUFLinear") == 2 * 4  # per layer: qkv, o, gate_up, down
        # the LM head: decode steps (<= 8 rows) on the embedding's or output's blocks
        assert kinds.count("GGUFHead") == 1
        got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=12), together=True)
        assert engine.stats()["num_preemptions"] > 0
        engine.check_integrity()
    assert [r.token_ids for r in got] == expected


def test_lora_adapters_on_gguf_blocks_equal_peft_on_the_expanded_model(tmp_path, tiny_hf):
    """S-LoRA on a GGUF model's blocks: float32 adapters on top of the block kernels, several
    adapters and the base model in one batch, against peft on transformers' expansion."""
    path = write_llama_gguf(tmp_path / "tiny-mixed.gguf", tiny_hf, LAYOUTS["mixed"])
    expanded = resolve_model_path(path)
    adapter_paths = {
        name: save_adapter(expanded, tmp_path / name, seed=i, **ADAPTERS[name])
        for i, name in enumerate(["qv4", "all8rs"])
    }
    names = ["qv4", None, "all8rs", "all8rs", "qv4", None]
    prompts = random_prompts([5, 9, 3, 12, 7, 4], 49152, seed=11)
    expected = peft_greedy(expanded, adapter_paths, prompts, names)
    base = peft_greedy(expanded, adapter_paths, prompts, [None] * len(prompts))
    assert all((e != b) == (name is not None) for name, e, b in zip(names, expected, base))
    cfg = EngineConfig(quant_policy="gguf", adapters=adapter_paths, num_gpu_blocks=64, block_size=4)
    with Engine.from_pretrained(path, cfg) as engine:
        kinds = [type(m).__name__ for m in engine.model_agent.runner.model.modules()]
        assert kinds.count("LoRAGGUFLinear") == 2 * 4
        from lmengine.api import Pipeline

        gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
        outs = Pipeline(engine)(prompts, gen_config=gen, adapter_name=names)
        engine.check_integrity()
    assert [o.token_ids for o in outs] == expected


def test_a_gguf_file_computes_on_its_blocks_by_default(tmp_path, tiny_hf, monkeypatch):
    """No quant_policy: a GGUF file's blocks on the CPU in float32; its float32 expansion with
    quant_policy="float", in another dtype, from the converted checkpoint folder, or where the
    blocks cannot be read (another architecture)."""
    path = write_llama_gguf(tmp_path / "tiny-q4.gguf", tiny_hf, LAYOUTS["q4"])
    cases = [
        (path, {}, 2 * 4),
        (path, {"quant_policy": "float"}, 0),
        (path, {"dtype": "bfloat16"}, 0),
        (resolve_model_path(path), {}, 0),
    ]
    for model_path, fields, num_block_linears in cases:
        with Engine.from_pretrained(model_path, EngineConfig(num_gpu_blocks=16, **fields)) as e:
            kinds = [type(m).__name__ for m in e.model_agent.runner.model.modules()]
            assert kinds.count("GGUFLinear") == num_block_linears, (model_path, fields)
            gen = GenerationConfig(max_new_tokens=2)
            assert e.create_instance().infer(0, [1, 2, 3], gen_config=gen).finish_reason == "length"

    def not_llama(gguf_file):
        raise ValueError(f"{gguf_file}: GGUF blocks are read for Llama-architecture files only")

    monkeypatch.setattr("lmengine.quant.gguf.read_gguf_blocks", not_llama)
    with Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16)) as engine:
        kinds = [type(m).__name__ for m in engine.model_agent.runner.model.modules()]
        assert "GGUFLinear" not in kinds
    with pytest.raises(ValueError, match="Llama-architecture files only"):
        Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16, quant_policy="gguf"))


def test_gguf_blocks_with_speculative_decoding_and_prefix_caching(tmp_path, tiny_hf):
    """n-gram drafts verified on the blocks (a few rows per sequence: the GEMV and the tiled
    GEMM), and prompts whose shared prefix comes from the prefix cache, still give the
    expanded model's greedy tokens."""
    path = write_llama_gguf(tmp_path / "tiny-mixed.gguf", tiny_hf, LAYOUTS["mixed"])
    shared = random_prompts([24], 49152, seed=9)[0]
    tails = random_prompts([3, 7, 5], 49152, seed=10)
    prompts = [shared + tail for tail in tails] + [[7, 8, 9] * 6]  # repetitive: n-gram drafts
    expected = hf_greedy(resolve_model_path(path), prompts, 16)
    cfg = EngineConfig(
        speculative="ngram", enable_prefix_caching=True, block_size=4, num_gpu_blocks=96
    )
    with Engine.from_pretrained(path, cfg) as engine:
        gen = GenerationConfig(max_new_tokens=16)
        first = run_threads(engine, prompts[:1], gen)
        rest = run_threads(engine, prompts[1:], gen)
        stats = engine.stats()
        assert stats["num_prefix_cached_tokens"] >= 2 * 24
        assert stats["speculative"]["num_accepted_tokens"] > 0
        engine.check_integrity()
    assert [r.token_ids for r in first + rest] == expected


# --- llama.cpp's files of other architectures ---------------------------------------------

DEEPSEEK_V3 = dict(
    num_key_value_heads=4,  # the heads: llama.cpp's converter splits kv_b_proj per KV head
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)

# GGUF architecture (or a test case of FILE_FORMS): (config class, model class, config
# overrides), shaped as llama.cpp's files can state them
TINY_ARCHITECTURES = {
    # six layers: llama.cpp's Gemma 3 has five sliding-window layers, then a global one; a
    # local rotary base of its own, a soft cap, and the embedding tied to the head, as Gemma's
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            final_logit_softcapping=8.0,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
            },
        ),
    ),
    # every other layer sliding, from the first (llama.cpp's pattern); yarn rotary scaling
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            tie_word_embeddings=False,
        ),
    ),
    # every layer routed: llama.cpp's Qwen3-MoE has no dense layers
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3: MLA with q through its low-rank path, yarn rotary, one dense layer, then
    # routed layers over 8 experts in 2 groups (best 1) plus a shared expert; written as
    # llama.cpp's converter writes it now (attn_k_b and attn_v_b, no attn_kv_b)
    "deepseek2": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**DEEPSEEK_V3, "num_hidden_layers": 3},
    ),
    # the query one matrix (as DeepSeek-V2-Lite's), no groups, the head tied; written as the
    # converter wrote it before llama.cpp's MLA (spring 2025): attn_kv_b only, per-head sizes
    "deepseek2-kv_b": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **DEEPSEEK_V3,
            "q_lora_rank": None,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}
# test case -> (its GGUF architecture, the MLA tensors its file holds), where the two differ
FILE_FORMS = {
    "deepseek2": ("deepseek2", ("attn_k_b", "attn_v_b")),
    "deepseek2-kv_b": ("deepseek2", ("attn_kv_b",)),
}


def gguf_arch(case: str) -> str:
    return FILE_FORMS.get(case, (case, ()))[0]


def save_tiny_arch(path, tokenizer_src: str, arch: str) -> str:
    """A tiny random model of GGUF architecture `arch` with SmolLM2's tokenizer, its matrices
    scaled up and its norms perturbed (as tests/test_models_parity.py's), saved to `path`."""
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, overrides = TINY_ARCHITECTURES[arch]  # arch: a test case
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    params = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    params.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**params))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.endswith("_bias"):  # gpt-oss's [E, out] expert biases
                p.mul_(8.0)
            else:
                p.add_(torch.randn_like(p) * 0.3)
            if arch == "gemma3" and name.endswith("norm.weight"):
                # NOTE: llama.cpp stores Gemma's norms as 1 + w in float32; weights that survive
                # the round trip keep the expansion bit for bit equal to the checkpoint
                p.copy_((p + 1) - 1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing correction
                b.add_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def add_deepseek2_fields(writer: gguf.GGUFWriter, cfg, mla_tensors: tuple[str, ...]) -> None:
    """DeepseekV2Model.set_gguf_parameters's keys. Files with attn_k_b (llama.cpp's MLA, since
    spring 2025) give the latent as one MQA head and the per-head sizes in *_mla; those of
    attn_k_b alone (the converter now) also the expert groups, which the converter writes since
    autumn 2025. The scoring function is DeepSeek-V3's (its config.json says sigmoid)."""
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if "attn_k_b" in mla_tensors:
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(qk_head_dim)
        writer.add_value_length_mla(cfg.v_head_dim)
    else:
        writer.add_key_length(qk_head_dim)
        writer.add_value_length(cfg.v_head_dim)
    if "attn_kv_b" not in mla_tensors:
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if cfg.rope_parameters["rope_type"] == "yarn":
        writer.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope_parameters["mscale_all_dim"])


def write_arch_gguf(path, hf_folder: str, arch: str, qtype=None, mla_tensors=None) -> str:
    """The checkpoint in `hf_folder` as llama.cpp's converter (convert_hf_to_gguf.py) writes a
    file of `arch` (or of the test case's architecture and form, FILE_FORMS): its metadata keys
    (TextModel.set_gguf_parameters and the architecture's own), its tensor names (gguf's
    TensorNameMap), Gemma's norms as 1 + w, the experts of a layer stacked [experts, out, in]
    (gpt-oss's gate and up apart, from transformers' interleaved [experts, in, 2 * out]),
    DeepSeek's kv_b_proj as `mla_tensors` (default: the case's) of attn_kv_b and its per-head
    halves attn_k_b (transposed) and attn_v_b, its rows in the checkpoint's rotary order (no
    permutation: llama.cpp's NORM rope is DeepSeek's interleaved one). Matrices in `qtype`
    (None: float32), except the router's and those whose rows do not split into its blocks
    (the converter's fallback); norms, biases and sinks float32. SmolLM2's tokenizer."""
    import re

    from safetensors.torch import load_file
    from transformers import AutoConfig

    arch, form = FILE_FORMS.get(arch, (arch, ()))
    mla_tensors = form if mla_tensors is None else mla_tensors
    cfg = AutoConfig.from_pretrained(hf_folder)
    state = load_file(f"{hf_folder}/model.safetensors")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    # MLA: the latent cache as one KV head
    writer.add_head_count_kv(1 if "attn_k_b" in mla_tensors else cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "deepseek2":
        add_deepseek2_fields(writer, cfg, mla_tensors)
    else:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "gpt-oss":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    add_smollm2_tokenizer(writer)

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)

    def add(name: str, weight: torch.Tensor) -> None:
        data = weight.float().contiguous().numpy()
        if (
            qtype is None
            or not name.endswith(".weight")
            or data.ndim < 2
            or "gate_inp" in name
            or data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]
        ):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for hf_name, weight in state.items():
        fused = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)", hf_name)
        if fused is not None:  # gpt-oss: [E, in, out] (gate and up interleaved on out)
            blk, part = f"blk.{fused.group(1)}", fused.group(2)
            stacked = weight.transpose(1, 2) if weight.dim() == 3 else weight  # [E, out(, in)]
            if part.startswith("gate_up_proj"):
                suffix = "bias" if part.endswith("_bias") else "weight"
                add(f"{blk}.ffn_gate_exps.{suffix}", stacked[:, ::2])
                add(f"{blk}.ffn_up_exps.{suffix}", stacked[:, 1::2])
            else:
                add(
                    f"{blk}.ffn_down_exps.{'bias' if part.endswith('_bias') else 'weight'}", stacked
                )
            continue
        if hf_name.endswith(".sinks"):  # gpt-oss's, a tensor of its own
            add(f"{names.get_name(hf_name)}.weight", weight)
            continue
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if expert is not None:
            layer, index, part = expert.groups()
            experts.setdefault((int(layer), part), {})[int(index)] = weight
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if hf_name.endswith("kv_b_proj.weight"):  # [heads * (nope + v), kv_lora]
            blk = names.get_name(base).removesuffix("attn_kv_b")
            per_head = weight.view(cfg.num_key_value_heads, -1, cfg.kv_lora_rank)
            k_b, v_b = per_head.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
            parts = {"attn_kv_b": weight, "attn_k_b": k_b.transpose(1, 2), "attn_v_b": v_b}
            for part in mla_tensors:
                add(f"{blk}{part}.weight", parts[part])
            continue
        if suffix == "e_score_correction_bias":  # DeepSeek's routing bias, exp_probs_b.bias
            add(f"{names.get_name(base + '.e_score_correction')}.bias", weight)
            continue
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            weight = weight + 1  # Gemma3RMSNorm multiplies by 1 + w; llama.cpp's by w
        add(f"{names.get_name(base)}.{suffix}", weight)
    for (layer, part), by_index in sorted(experts.items()):
        stacked = torch.stack([by_index[i] for i in sorted(by_index)])
        add(f"{names.get_name(f'model.layers.{layer}.mlp.experts.{part}')}.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module", params=sorted(TINY_ARCHITECTURES))
def tiny_arch(request, tmp_path_factory, smollm2_path) -> tuple[str, str]:
    """(a test case of TINY_ARCHITECTURES, its checkpoint's folder)"""
    arch = request.param
    return arch, save_tiny_arch(tmp_path_factory.mktemp(f"tiny_{arch}"), smollm2_path, arch)


def _state(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_a_llama_cpp_file_expands_to_the_checkpoint_it_was_written_from(tmp_path, tiny_arch):
    """Float32 tensors: transformers' expansion (with the settings lmengine puts back) holds the
    checkpoint's config and weights bit for bit, and the engine on it gives the checkpoint's
    greedy tokens, from threads, with chunked prompts and preemption."""
    case, hf_folder = tiny_arch
    path = write_arch_gguf(tmp_path / f"tiny-{case}-f32.gguf", hf_folder, case)
    expanded = resolve_model_path(path)
    original, got_state = _state(hf_folder), _state(expanded)
    assert sorted(got_state) == sorted(original)
    assert all(torch.equal(got_state[k], original[k]) for k in original), case
    from transformers import AutoConfig

    want, have = AutoConfig.from_pretrained(hf_folder), AutoConfig.from_pretrained(expanded)
    for key in ["query_pre_attn_scalar", "layer_types", "rope_parameters", "sliding_window",
                "final_logit_softcapping", "moe_intermediate_size", "num_experts_per_tok",
                "norm_topk_prob", "head_dim", "tie_word_embeddings", "num_local_experts",
                "intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
                "rope_interleave"]:  # fmt: skip
        assert getattr(have, key, None) == getattr(want, key, None), key

    prompts = random_prompts([1, 6, 19, 40, 23], 49152, seed=3)
    expected = hf_greedy(hf_folder, prompts, 12)
    assert len({t for tokens in expected for t in tokens}) > 10
    cfg = EngineConfig(
        quant_policy="float", block_size=4, num_gpu_blocks=20, max_prefill_token_num=24
    )
    with Engine.from_pretrained(path, cfg) as engine:
        assert type(engine.model_agent.runner.model).__name__.startswith("Patched")
        got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=12), together=True)
        assert engine.stats()["num_preemptions"] > 0
        engine.check_integrity()
    assert [r.token_ids for r in got] == expected


def test_their_attention_and_mlp_linears_compute_on_the_files_blocks(tmp_path, tiny_arch):
    """Q8_0 matrices: quant_policy="gguf" puts the attention and dense MLP linears (and the LM
    head's decode rows) on the file's blocks, the experts stay float32, and the greedy tokens
    are those of transformers' expansion of the file. gpt-oss's blocks are not read: refused
    under "gguf", its expansion by default."""
    case, hf_folder = tiny_arch
    arch = gguf_arch(case)
    path = write_arch_gguf(tmp_path / f"tiny-{case}-q8_0.gguf", hf_folder, case, Q.Q8_0)
    prompts = random_prompts([1, 6, 19, 40, 23], 49152, seed=4)
    expected = hf_greedy(resolve_model_path(path), prompts, 12)
    cfg = EngineConfig(quant_policy="gguf", block_size=4, num_gpu_blocks=64)
    if arch not in BLOCK_ARCHITECTURES:
        with pytest.raises(ValueError, match=f"this one is '{arch}'.*quant_policy=None"):
            Engine.from_pretrained(path, cfg)
        cfg = EngineConfig(block_size=4, num_gpu_blocks=64, dtype="float32")
    with Engine.from_pretrained(path, cfg) as engine:
        model = engine.model_agent.runner.model
        kinds = [type(m).__name__ for m in model.modules()]
        per_layer = {"gemma3": 4, "qwen3moe": 2}.get(arch, 0)  # qkv, o (and gate_up, down)
        assert kinds.count("GGUFLinear") == per_layer * model.config.num_hidden_layers
        assert kinds.count("GGUFHead") == (arch in BLOCK_ARCHITECTURES)
        got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=12))
        engine.check_integrity()
    assert [r.token_ids for r in got] == expected


def test_a_deepseek2_file_with_kv_b_and_its_halves_expands_to_the_checkpoint(
    tmp_path, smollm2_path
):
    """The form llama.cpp's converter wrote in mid-2025: attn_kv_b kept beside attn_k_b and
    attn_v_b (the cases "deepseek2" and "deepseek2-kv_b" above hold the halves alone and
    attn_kv_b alone); kv_b_proj comes back bit for bit."""
    hf_folder = save_tiny_arch(tmp_path / "hf", smollm2_path, "deepseek2")
    mla_tensors = ("attn_kv_b", "attn_k_b", "attn_v_b")
    path = write_arch_gguf(tmp_path / "tiny.gguf", hf_folder, "deepseek2", mla_tensors=mla_tensors)
    original, got_state = _state(hf_folder), _state(resolve_model_path(path))
    assert sorted(got_state) == sorted(original)
    assert all(torch.equal(got_state[k], original[k]) for k in original)


def test_a_deepseek2_file_of_softmax_routing_is_refused_naming_it(tmp_path):
    """DeepSeek-V2's files (no gating key: llama.cpp's softmax) route their experts in a way
    DeepseekV3's router does not."""
    tensors = {"token_embd.weight": (np.zeros((8, 64), dtype=np.float32), None)}
    path = _write_minimal_gguf(tmp_path / "deepseek-v2.gguf", "deepseek2", tensors)
    with pytest.raises(ValueError, match="routes its experts by softmax"):
        Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16))


def _write_minimal_gguf(path, arch: str, tensors: dict) -> str:
    """A file with the architecture `arch` and `tensors` (name: (array, raw GGML type or
    None)). No tokenizer: each refusal comes before anything reads one (a later refusal fails
    the test on another error), and a 49k vocabulary takes seconds to parse."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("arch", ["dots1", "olmo2", "smollm3", "granite", "glm4"])
def test_a_file_of_an_architecture_nothing_reads_is_refused_naming_it(tmp_path, arch):
    """Refused before transformers is asked (whatever quant_policy: the file is expanded
    first), naming the architecture and those that load."""
    embedding = np.zeros((8, 64), dtype=np.float32)
    tensors = {"token_embd.weight": (embedding, None)}
    path = _write_minimal_gguf(tmp_path / f"{arch}.gguf", arch, tensors)
    match = rf"GGUF architecture '{arch}' cannot be loaded: GGUF files of the architectures "
    with pytest.raises(ValueError, match=match + r".*gemma3, .*gpt-oss, .*llama, .*qwen3moe"):
        Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16))


def test_a_file_whose_tensors_do_not_fill_the_model_is_refused(tmp_path, monkeypatch, smollm2_path):
    """Where transformers reads an architecture's metadata but leaves weights of the model
    unfilled or of another shape (here Qwen3-MoE's experts without the width lmengine puts
    back), the error names them, instead of a model computing on random weights."""
    from lmengine.engine import gguf_convert

    hf_folder = save_tiny_arch(tmp_path / "hf", smollm2_path, "qwen3moe")
    path = write_arch_gguf(tmp_path / "tiny-qwen3moe.gguf", hf_folder, "qwen3moe")
    monkeypatch.setitem(gguf_convert.GGUF_CONFIG_FIXES, "qwen3moe", lambda config, reader: None)
    match = r"architecture 'qwen3moe' is read, but 4 weights .*mlp\.experts\.down_proj"
    with pytest.raises(ValueError, match=match):
        Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16))


def test_a_tensor_type_that_cannot_be_dequantized_is_refused_naming_it(tmp_path):
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_K][1]
    tensors = {
        "token_embd.weight": (np.zeros((8, 64), dtype=np.float32), None),
        "blk.0.attn_q.weight": (np.zeros((4, block_bytes), np.uint8), Q.Q8_K),  # 4 x 256
    }
    path = _write_minimal_gguf(tmp_path / "q8_k.gguf", "llama", tensors)
    match = "tensor blk.0.attn_q.weight is stored as Q8_K, a type the gguf package cannot"
    for policy in [None, "float", "gguf"]:
        with pytest.raises(ValueError, match=match):
            Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=16, quant_policy=policy))


def test_a_tensor_type_the_gguf_package_does_not_know_is_refused_naming_it(tmp_path):
    """A file newer than the installed gguf package: a type id it has no name for."""
    import struct

    tensors = {"token_embd.weight": (np.zeros((8, 64), dtype=np.float32), None)}
    path = tmp_path / "new-type.gguf"
    data = bytearray(Path(_write_minimal_gguf(path, "llama", tensors)).read_bytes())
    end = data.index(b"token_embd.weight") + len(b"token_embd.weight")
    (num_dims,) = struct.unpack_from("<I", data, end)
    struct.pack_into("<I", data, end + 4 + 8 * num_dims, 250)  # the tensor's type id
    path.write_bytes(data)
    with pytest.raises(ValueError, match="a tensor of GGML type 250, a type the installed gguf"):
        Engine.from_pretrained(str(path), EngineConfig(num_gpu_blocks=16))
