"""MODULE_MAP: HF qualified class name -> lmengine qualified class name.

`patch(model)` swaps the class of every module whose class is a key here for the mapped
lmengine class (a subclass of the HF class: the weights stay, the behaviour changes).
A model is supported when its `*ForCausalLM` class is a key. Add entries with
`register_module` (or `EngineConfig`-level extra maps) without editing this file.
"""

from __future__ import annotations

_LLAMA = "transformers.models.llama.modeling_llama"
_PATCH = "lmengine.models.llama"

MODULE_MAP: dict[str, str] = {
    f"{_LLAMA}.LlamaForCausalLM": f"{_PATCH}.PatchedLlamaForCausalLM",
    f"{_LLAMA}.LlamaModel": f"{_PATCH}.PatchedLlamaModel",
    f"{_LLAMA}.LlamaDecoderLayer": f"{_PATCH}.PatchedLlamaDecoderLayer",
    f"{_LLAMA}.LlamaAttention": f"{_PATCH}.PatchedLlamaAttention",
    f"{_LLAMA}.LlamaMLP": f"{_PATCH}.PatchedLlamaMLP",
    f"{_LLAMA}.LlamaRMSNorm": f"{_PATCH}.PatchedRMSNorm",
}


def register_module(hf_qualname: str, lmengine_qualname: str) -> None:
    """Map one more HF class to a patched class (both as 'package.module.ClassName')."""
    MODULE_MAP[hf_qualname] = lmengine_qualname
