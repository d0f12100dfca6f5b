"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2/V3/R1, Kimi K2) expanded by lmengine into a
float32 `DeepseekV3ForCausalLM`: transformers 5.23 reads neither their metadata nor their
tensors.

What llama.cpp's converter (convert_hf_to_gguf.py, `DeepseekV2Model`) does to a checkpoint, and
how it is undone here:
- Multi-head latent attention is written in its MQA form: one KV "head" of kv_lora_rank +
  rope width (`attention.key_length`, `attention.value_length`, `attention.head_count_kv` 1);
  the per-head sizes sit in `attention.key_length_mla` / `value_length_mla`. Files from before
  llama.cpp's MLA (spring 2025) give the per-head sizes in `key_length` / `value_length`.
- `kv_b_proj` [heads * (nope + v), kv_lora] is split per head into `attn_k_b` (the no-rope key
  rows, transposed: [heads, kv_lora, nope]) and `attn_v_b` ([heads, v, kv_lora]); files of
  mid-2025 keep `attn_kv_b` as well, files from before MLA have only `attn_kv_b`. Both halves
  are put back into the one matrix; where a file has both forms, the split one (what llama.cpp
  computes with) wins.
- The query and rope-key rows are not permuted: DeepSeek's rotary pairs are interleaved
  (`rope_interleave`), which is llama.cpp's NORM rope, so the rows are the checkpoint's.
- The experts are stacked [experts, out, in]; the routing bias `e_score_correction_bias` is
  `exp_probs_b.bias`.
"""

from __future__ import annotations

import re

import numpy as np
import torch

# llama.cpp's expert gating functions (gguf.ExpertGatingFuncType)
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (2.827, not 2.8269999)."""
    return float(str(np.float32(value)))


def _deepseek2_config(reader, gguf_path):
    """A DeepseekV3Config from llama.cpp's deepseek2 metadata. Raises ValueError for a file of
    softmax routing (DeepSeek-V2, V2.5, V2-Lite), which DeepseekV3's router (sigmoid plus a
    correction bias) does not compute."""
    from transformers import DeepseekV3Config

    from lmengine.engine.gguf_blocks import gguf_field

    def field(key: str):
        return gguf_field(reader, f"deepseek2.{key}")

    def token_id(key: str):
        return gguf_field(reader, f"tokenizer.ggml.{key}_token_id")

    # NOTE: llama.cpp takes a file without the key for softmax (its DeepSeek-V2 files)
    gating = field("expert_gating_func") or _GATING_SOFTMAX
    if gating != _GATING_SIGMOID:
        raise ValueError(
            f"{gguf_path}: this deepseek2 file routes its experts by softmax (expert_gating_func "
            f"{gating}: DeepSeek-V2, V2.5 or V2-Lite); lmengine reads deepseek2 files of sigmoid "
            "routing (DeepSeek-V3, R1, Kimi K2). Load the model's safetensors checkpoint instead"
        )
    heads = field("attention.head_count")
    rope_dim = field("rope.dimension_count")
    rope = {"rope_type": "default", "rope_theta": _f32(field("rope.freq_base") or 10000.0)}
    if field("rope.scaling.type") == "yarn":
        # NOTE: the converter writes yarn_log_multiplier = 0.1 * mscale_all_dim, and no mscale:
        # llama.cpp's graph cancels ggml's own yarn magnitude factor, which is transformers'
        # attention_factor = 1 of mscale == mscale_all_dim (DeepSeek-V3's and Kimi K2's 1.0)
        mscale = round(_f32(field("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1, 6)
        rope.update(
            rope_type="yarn",
            factor=_f32(field("rope.scaling.factor")),
            original_max_position_embeddings=int(field("rope.scaling.original_context_length")),
            # llama.cpp's defaults where the file has no key, and DeepSeek-V3's values
            beta_fast=_f32(field("rope.scaling.yarn_beta_fast") or 32.0),
            beta_slow=_f32(field("rope.scaling.yarn_beta_slow") or 1.0),
            mscale=mscale,
            mscale_all_dim=mscale,
        )
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return DeepseekV3Config(
        vocab_size=field("vocab_size") or len(tokens.data),
        hidden_size=field("embedding_length"),
        intermediate_size=field("feed_forward_length"),  # the leading dense layers'
        moe_intermediate_size=field("expert_feed_forward_length"),
        num_hidden_layers=field("block_count"),
        num_attention_heads=heads,
        # NOTE: head_count_kv is 1 in MLA files (the latent cache as one MQA head); the model's
        # keys and values are per head
        num_key_value_heads=heads,
        q_lora_rank=field("attention.q_lora_rank"),  # absent where q_proj is one matrix
        kv_lora_rank=field("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=(field("attention.key_length_mla") or field("attention.key_length"))
        - rope_dim,
        v_head_dim=field("attention.value_length_mla") or field("attention.value_length"),
        n_routed_experts=field("expert_count"),
        num_experts_per_tok=field("expert_used_count"),
        n_shared_experts=field("expert_shared_count"),
        first_k_dense_replace=field("leading_dense_block_count"),
        # NOTE: files written before llama.cpp routed by groups (autumn 2025) have no group
        # keys, and llama.cpp routes them over all experts: one group
        n_group=field("expert_group_count") or 1,
        topk_group=field("expert_group_used_count") or 1,
        # llama.cpp's defaults where the key is absent: no scaling, no renormalization
        routed_scaling_factor=_f32(field("expert_weights_scale") or 1.0),
        norm_topk_prob=bool(field("expert_weights_norm")),
        max_position_embeddings=field("context_length"),
        rms_norm_eps=_f32(field("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        rope_interleave=True,  # llama.cpp's NORM rope of deepseek2, fixed in its code
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=token_id("bos"),
        eos_token_id=token_id("eos"),
        pad_token_id=token_id("padding"),
        architectures=["DeepseekV3ForCausalLM"],
    )


def _deepseek2_tensors(model, reader) -> set[str]:
    """Load llama.cpp's deepseek2 tensors into `model` (weights and the routing-bias buffers);
    returns the names of the state-dict entries filled."""
    import gguf

    from lmengine.engine.gguf_blocks import read_gguf_tensor

    config = model.config
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config.num_hidden_layers)

    def read(name: str) -> torch.Tensor | None:
        return read_gguf_tensor(tensors[name]) if name in tensors else None

    def kv_b(blk: str) -> torch.Tensor | None:
        k_b, v_b = read(blk + "attn_k_b.weight"), read(blk + "attn_v_b.weight")
        if k_b is None or v_b is None or k_b.dim() != 3:
            return read(blk + "attn_kv_b.weight")  # [heads * (nope + v), kv_lora]
        # [heads, kv_lora, nope] and [heads, v, kv_lora] -> [heads * (nope + v), kv_lora]
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)

    def value(key: str) -> torch.Tensor | None:
        layer = re.match(r"model\.layers\.(\d+)\.", key)
        blk = f"blk.{layer.group(1)}." if layer else ""
        if key.endswith("self_attn.kv_b_proj.weight"):
            return kv_b(blk)
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = read(blk + "ffn_gate_exps.weight"), read(blk + "ffn_up_exps.weight")
            return None if gate is None or up is None else torch.cat([gate, up], dim=1)
        if key.endswith("mlp.experts.down_proj"):  # [E, H, I]
            return read(blk + "ffn_down_exps.weight")
        if key.endswith("mlp.gate.e_score_correction_bias"):  # [E]
            return read(blk + "exp_probs_b.bias")
        if key == "lm_head.weight":
            return read("output.weight")
        base, suffix = key.rsplit(".", 1)
        gguf_name = names.get_name(base)
        return None if gguf_name is None else read(f"{gguf_name}.{suffix}")

    state = model.state_dict()
    filled = set()
    with torch.no_grad():
        for key, target in state.items():
            got = value(key)
            if got is not None and got.shape == target.shape:
                target.copy_(got)
                filled.add(key)
    return filled


def load_deepseek2(reader, gguf_path):
    """(the float32 DeepseekV3ForCausalLM expanded from a deepseek2 file, names of the weights
    left unfilled)."""
    from transformers import AutoModelForCausalLM

    config = _deepseek2_config(reader, gguf_path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    filled = _deepseek2_tensors(model, reader)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return model, set(model.state_dict()) - filled - tied
