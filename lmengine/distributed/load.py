"""Building one rank's shard of a model: the HF model on the meta device, patched, sharded,
then only this rank's slices read from the safetensors files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from lmengine.distributed.checkpoint import CheckpointReader, materialize
from lmengine.distributed.shard import shard_model
from lmengine.engine.loader import pick_dtype, resolve_model_path
from lmengine.models import patch
from lmengine.models.model_info import ModelInfo


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter created inside goes to the meta device (no memory); buffers such as
    rotary frequencies stay real, since they are computed, not loaded."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def local_checkpoint(model_path: str | None) -> str:
    """A local folder for `model_path` (hub ids are fetched to the HF cache first)."""
    path = resolve_model_path(model_path)
    if not Path(path).is_dir():
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model"])
    return path


def check_tp(info: ModelInfo, tp: int, device: torch.device) -> None:
    """Raise ValueError unless `tp` ranks can split this model on this machine."""
    if tp == 1:
        return
    if tp > info.num_heads or info.num_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_attention_heads={info.num_heads}: each rank needs "
            "the same whole number of attention heads; use a tp that divides it"
        )
    kv = info.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"tp={tp} and num_key_value_heads={kv}: the KV heads must split evenly over the "
            "ranks (tp divides them) or be shared evenly (tp a multiple of them)"
        )
    if device.type == "cuda":
        available = torch.cuda.device_count()
        if tp > available and "MASTER_ADDR" not in os.environ:
            raise ValueError(f"tp={tp} needs {tp} GPUs, {available} visible")
    else:
        cores = os.cpu_count() or 1
        if tp > cores:
            raise ValueError(f"tp={tp} ranks on {cores} CPU cores: use tp <= {cores}")


def load_shard(
    path: str, dtype: str, device: torch.device, rank: int, tp: int, trust_remote_code: bool
) -> tuple[nn.Module, ModelInfo]:
    """This rank's patched, sharded model in eval mode on `device`, and the model's info."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from lmengine.quant.w8a8 import quantize_lm_head, quantize_model, read_quant_config

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    quant_config = read_quant_config(path)
    is_w8a8 = quant_config is not None
    if is_w8a8:
        del config.quantization_config  # NOTE: transformers knows no such quantizer
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    info = ModelInfo.from_hf(config, generation_config)
    check_tp(info, tp, device)
    torch_dtype = pick_dtype(dtype, device, config, "w8a8" if is_w8a8 else None)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    model.eval().requires_grad_(False)
    patch(model)
    if is_w8a8:  # the int8 structure (on meta), then sharded like the float one
        quantize_model(model, None, None, quantize_weights=False)
    load = shard_model(model, rank, tp)
    materialize(model, load, CheckpointReader(path), device)
    if is_w8a8 and quant_config.get("lm_head") == "int8":
        quantize_lm_head(model)  # this rank's vocabulary rows, exactly as with tp=1
    return model, info


def weight_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (tied ones counted once) and saved buffers (int8
    weights and scales of w8a8)."""
    tensors = list(model.parameters())
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                tensors.append(buf)
    return sum(t.numel() * t.element_size() for t in tensors)


def load_tokenizer(model_path: str | None, dtype: str, device: str, trust_remote_code=False):
    """The engine's loader for tp > 1: (None, tokenizer, local folder, device); the model
    agent loads the shards."""
    from transformers import AutoTokenizer

    from lmengine.engine.loader import pick_device

    path = local_checkpoint(model_path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return None, tokenizer, path, pick_device(device)
