"""The w8a8 checkpoint format on disk: safetensors of the patched, quantized state dict plus a
`config.json` whose `quantization_config` names `QUANT_METHOD`.

The loader (`lmengine.engine.loader`) reads a checkpoint through this module without importing
the quantizer; the int8 tensors are loaded after patching (`lmengine.quant.w8a8.load_quantized`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lmengine.quant.layout import get_layout

QUANT_METHOD = "lmengine_w8a8"


def read_quant_config(path: str | Path) -> dict | None:
    """The `quantization_config` of a lmengine w8a8 checkpoint folder, else None."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    qc = json.loads(config_file.read_text(encoding="utf-8")).get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD:
        return qc
    return None


def save_quantized(model: nn.Module, tokenizer, out_dir: str | Path, quant_config: dict) -> Path:
    """Write the patched, quantized model as safetensors + config.json (+ tokenizer)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # NOTE: tied to the embeddings; re-tied on load
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = dict(quant_config, quant_method=QUANT_METHOD)
    try:
        model.config.save_pretrained(out)
    finally:
        del model.config.quantization_config
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def build_skeleton(path: str | Path, dtype: torch.dtype, trust_remote_code: bool = False):
    """The HF model of a w8a8 checkpoint with placeholder weights; `load_quantized` fills it
    after patching. It carries the checkpoint folder in `lmengine_w8a8_checkpoint`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # NOTE: transformers knows no such quantizer
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: pay for a random init
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():  # NOTE: every tensor is overwritten by load_quantized
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    get_layout(model)  # a clear error before anything else
    model.lmengine_w8a8_checkpoint = str(path)
    return model
