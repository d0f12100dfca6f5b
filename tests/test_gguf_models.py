"""Tiny random Llamas written as GGUF files by the test (Q4_0, Q4_1 and Q8_0 blocks, the
llama.cpp converter's rotary row order, SmolLM2's tokenizer), loaded through the real loading
code: computing on their blocks (quant_policy="gguf") gives the greedy tokens of the float32
model transformers expands the same file to."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine.gguf_blocks import LLAMA_LINEARS as LAYER_TENSORS
from lmengine.engine.loader import default_gguf_path, resolve_model_path
from tests.conftest import save_tiny_llama
from tests.engine_utils import random_prompts, run_threads
from tests.hf_reference import hf_greedy
from tests.kernels.test_gguf import random_k_blocks
from tests.test_lora import ADAPTERS, peft_greedy, save_adapter

Q = gguf.GGMLQuantizationType

LAYOUTS = {  # block type of each linear, and of the token embedding (tied to the LM head)
    "q4_0": dict.fromkeys([*LAYER_TENSORS, "token_embd"], Q.Q4_0),
    "q4_1": dict.fromkeys([*LAYER_TENSORS, "token_embd"], Q.Q4_1),
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


def add_smollm2_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The tokenizer fields of lmengine's default GGUF file (SmolLM2's), copied into `writer`."""
    for field in gguf.GGUFReader(str(default_gguf_path())).fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


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
    path = write_llama_gguf(tmp_path / "tiny-q4_1.gguf", tiny_hf, LAYOUTS["q4_1"])
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
