"""MODULE_MAP: HF qualified class name -> lmengine qualified class name.

`patch(model)` swaps the class of every module whose class is a key here for the mapped
lmengine class (a subclass of the HF class: the weights stay, the behaviour changes).
A model is supported when its `*ForCausalLM` class is a key. Add entries with
`register_module` or `EngineConfig(module_map=...)` without editing this file.
"""

from __future__ import annotations

_HF = "transformers.models"
_LLAMA = f"{_HF}.llama.modeling_llama"
_PATCH = "lmengine.models.llama"


def _family(hf_module: str, patch_module: str, names: list[str]) -> dict[str, str]:
    """`{hf_module}.X -> {patch_module}.PatchedX` for each class name X."""
    return {f"{_HF}.{hf_module}.{n}": f"lmengine.models.{patch_module}.Patched{n}" for n in names}


def _llama_like(prefix: str, hf_module: str, patch_module: str, norm: str = "RMSNorm"):
    parts = ["ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", norm]
    return _family(hf_module, patch_module, [prefix + p for p in parts])


MODULE_MAP: dict[str, str] = {
    # Llama keeps its explicit entries: they are the template the guide starts from
    f"{_LLAMA}.LlamaForCausalLM": f"{_PATCH}.PatchedLlamaForCausalLM",
    f"{_LLAMA}.LlamaModel": f"{_PATCH}.PatchedLlamaModel",
    f"{_LLAMA}.LlamaDecoderLayer": f"{_PATCH}.PatchedLlamaDecoderLayer",
    f"{_LLAMA}.LlamaAttention": f"{_PATCH}.PatchedLlamaAttention",
    f"{_LLAMA}.LlamaMLP": f"{_PATCH}.PatchedLlamaMLP",
    f"{_LLAMA}.LlamaRMSNorm": f"{_PATCH}.PatchedRMSNorm",
    **_llama_like("Qwen2", "qwen2.modeling_qwen2", "qwen"),
    **_llama_like("Qwen3", "qwen3.modeling_qwen3", "qwen"),
    **_llama_like("Qwen3Moe", "qwen3_moe.modeling_qwen3_moe", "qwen"),
    f"{_HF}.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock": (
        "lmengine.models.qwen.PatchedQwen3MoeSparseMoeBlock"
    ),
    **_llama_like("Mistral", "mistral.modeling_mistral", "mistral"),
    **_llama_like("Gemma2", "gemma2.modeling_gemma2", "gemma2"),
    **_llama_like("Phi3", "phi3.modeling_phi3", "phi3"),
    **_llama_like("Olmo2", "olmo2.modeling_olmo2", "olmo2"),
    **_llama_like("SmolLM3", "smollm3.modeling_smollm3", "smollm3"),
    **_llama_like("Granite", "granite.modeling_granite", "granite"),
    **_llama_like("Glm4", "glm4.modeling_glm4", "glm4"),
    **_family(
        "gemma3.modeling_gemma3",
        "gemma3",
        [
            "Gemma3ForCausalLM",
            "Gemma3TextModel",
            "Gemma3DecoderLayer",
            "Gemma3Attention",
            "Gemma3MLP",
            "Gemma3RMSNorm",
        ],
    ),
    **_family(
        "mixtral.modeling_mixtral",
        "mistral",
        [
            "MixtralForCausalLM",
            "MixtralModel",
            "MixtralDecoderLayer",
            "MixtralAttention",
            "MixtralSparseMoeBlock",
            "MixtralRMSNorm",
        ],
    ),
    **_family(
        "deepseek_v3.modeling_deepseek_v3",
        "deepseek",
        [
            "DeepseekV3ForCausalLM",
            "DeepseekV3Model",
            "DeepseekV3DecoderLayer",
            "DeepseekV3Attention",
            "DeepseekV3MLP",
            "DeepseekV3MoE",
            "DeepseekV3RMSNorm",
        ],
    ),
    **_family(
        "gpt_oss.modeling_gpt_oss",
        "gpt_oss",
        [
            "GptOssForCausalLM",
            "GptOssModel",
            "GptOssDecoderLayer",
            "GptOssAttention",
            "GptOssMLP",
            "GptOssRMSNorm",
        ],
    ),
    **_family(
        "opt.modeling_opt",
        "opt",
        ["OPTForCausalLM", "OPTModel", "OPTDecoder", "OPTDecoderLayer", "OPTAttention"],
    ),
    **_family(
        "gpt_neox.modeling_gpt_neox",
        "gpt_neox",
        [
            "GPTNeoXForCausalLM",
            "GPTNeoXModel",
            "GPTNeoXLayer",
            "GPTNeoXAttention",
            "GPTNeoXMLP",
        ],
    ),
}


def register_module(hf_qualname: str, lmengine_qualname: str) -> None:
    """Map one more HF class to a patched class (both as 'package.module.ClassName')."""
    MODULE_MAP[hf_qualname] = lmengine_qualname
