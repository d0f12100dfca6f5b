"""A GGUF file expanded once into a float32 safetensors folder.

A GGUF file is expanded by transformers' GGUF loading (`convert_gguf`; gpt-oss and deepseek2
files, which transformers 5.23 does not read, by lmengine: deepseek2's in gguf_deepseek2.py),
after `check_gguf_file` has refused, naming the reason, the files that cannot be expanded: an
architecture neither reads, a tensor type the gguf package cannot dequantize. Settings that
llama.cpp's files leave out (it fixes them in code) and transformers does not read are put back
per architecture (`GGUF_CONFIG_FIXES`), and a file whose tensors do not fill the whole model is
refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("lmengine")


# GGUF architectures (llama.cpp's names) whose files lmengine loads and has checked token for
# token against the checkpoint they were written from (tests/test_gguf_models.py); other
# architectures that transformers reads are tried
TESTED_GGUF_ARCHITECTURES = ("llama", "gemma3", "qwen3moe", "gpt-oss", "deepseek2")
# llama.cpp's name -> the one transformers' GGUF tables use, where the two differ
_TRANSFORMERS_GGUF_NAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


def transformers_gguf_architectures() -> list[str] | None:
    """The GGUF architectures (llama.cpp's names) whose files load: those the installed
    transformers expands, gpt-oss and deepseek2; None where transformers' tables are not where this
    version of lmengine looks for them."""
    import gguf

    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return None
    llama_cpp_names = set(gguf.MODEL_ARCH_NAMES.values())
    theirs = {v: k for k, v in _TRANSFORMERS_GGUF_NAMES.items()}
    names = {theirs.get(a, a) for a in [*GGUF_SUPPORTED_ARCHITECTURES, *GGUF_CONFIG_ARCHS]}
    own = {"gpt-oss", "deepseek2"}  # lmengine's own reading
    return sorted((names | own) & llama_cpp_names)


def check_gguf_file(gguf_path: str | Path):
    """Raise ValueError, naming the reason, for a GGUF file that cannot be expanded: a cut file,
    an architecture transformers does not read (naming those it does), a tensor type the gguf
    package does not know or cannot dequantize (naming the type and a tensor). Returns the
    open `gguf.GGUFReader`."""
    import gguf
    import numpy as np
    import transformers

    from lmengine.engine.gguf_blocks import gguf_field, open_gguf

    reader = open_gguf(str(gguf_path))
    arch = gguf_field(reader, "general.architecture")
    readable = transformers_gguf_architectures()
    if readable is not None and arch not in readable:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} cannot be loaded: GGUF files of the "
            f"architectures {', '.join(readable)} load (through transformers "
            f"{transformers.__version__}'s GGUF support; gpt-oss and deepseek2 through "
            f"lmengine's; tested: {', '.join(TESTED_GGUF_ARCHITECTURES)}). Load the model's "
            "safetensors checkpoint (a folder or a hub id) instead"
        )
    seen = set()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype in seen:
            continue
        seen.add(qtype)
        # one block is enough to learn whether the package dequantizes the type
        one_block = np.asarray(tensor.data).reshape(-1)[: gguf.GGML_QUANT_SIZES[qtype][1]]
        try:
            gguf.quants.dequantize(one_block.reshape(1, -1), qtype)
        except NotImplementedError:
            raise ValueError(
                f"{gguf_path}: tensor {tensor.name} is stored as {qtype.name}, a type the gguf "
                "package cannot dequantize, so the file cannot be expanded (F32, F16, BF16 and "
                "llama.cpp's quantized types Q4_0 ... Q8_0, Q2_K ... Q6_K and the IQ types can)"
            ) from None
    return reader


def _gemma3_config(config, reader) -> None:
    """What llama.cpp's Gemma 3 sets in code (llama-model.cpp) and transformers does not read:
    queries scaled by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) on the 27B (62 layers); five
    sliding-window layers, then one global, none sliding without a window; a local rotary base
    of 10,000 unless the file gives one; the final logit soft cap the file gives."""
    from lmengine.engine.gguf_blocks import gguf_field

    num_layers = config.num_hidden_layers
    wide = num_layers == 62  # llama.cpp's LLM_TYPE_27B
    config.query_pre_attn_scalar = (
        config.hidden_size // config.num_attention_heads if wide else config.head_dim
    )
    window = gguf_field(reader, "gemma3.attention.sliding_window")
    config.layer_types = [
        "sliding_attention" if window and (i + 1) % 6 else "full_attention"
        for i in range(num_layers)
    ]
    local_theta = gguf_field(reader, "gemma3.rope.freq_base_swa") or 10000.0
    config.rope_parameters["sliding_attention"]["rope_theta"] = float(local_theta)
    softcap = gguf_field(reader, "gemma3.final_logit_softcapping")
    if softcap:
        config.final_logit_softcapping = float(softcap)


def _qwen3moe_config(config, reader) -> None:
    """The experts' width, which transformers does not read (it keeps its default, 768)."""
    from lmengine.engine.gguf_blocks import gguf_field

    width = gguf_field(reader, "qwen3moe.expert_feed_forward_length")
    if width:
        config.moe_intermediate_size = int(width)


def _gpt_oss_config(reader):
    """A GptOssConfig from llama.cpp's gpt-oss metadata. transformers 5.23 reads these files
    neither whole (it fails on their yarn keys and leaves out the head size and window) nor
    their experts and sinks, so lmengine expands them itself. llama.cpp fixes in code: every
    other layer sliding, from the first; the SwiGLU clamp (7) and its alpha (1.702), which are
    the config's defaults."""
    from transformers import GptOssConfig

    from lmengine.engine.gguf_blocks import gguf_field

    def field(key: str):
        return gguf_field(reader, f"gpt-oss.{key}")

    def token_id(key: str):
        return gguf_field(reader, f"tokenizer.ggml.{key}_token_id")

    num_layers = field("block_count")
    rope = {"rope_type": "default", "rope_theta": float(field("rope.freq_base") or 150000.0)}
    if field("rope.scaling.type") == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(field("rope.scaling.factor")),
            original_max_position_embeddings=int(field("rope.scaling.original_context_length")),
            truncate=False,  # gpt-oss's; the file has no key for it
        )
        for key in ["beta_fast", "beta_slow"]:
            if field(f"rope.scaling.yarn_{key}") is not None:
                rope[key] = float(field(f"rope.scaling.yarn_{key}"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return GptOssConfig(
        vocab_size=field("vocab_size") or len(tokens.data),
        hidden_size=field("embedding_length"),
        intermediate_size=field("expert_feed_forward_length") or field("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=field("attention.head_count"),
        num_key_value_heads=field("attention.head_count_kv"),
        head_dim=field("attention.key_length"),
        num_local_experts=field("expert_count"),
        num_experts_per_tok=field("expert_used_count"),
        max_position_embeddings=field("context_length"),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        sliding_window=field("attention.sliding_window"),
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ],
        rope_parameters=rope,
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=token_id("bos"),
        eos_token_id=token_id("eos"),
        pad_token_id=token_id("padding"),
        architectures=["GptOssForCausalLM"],
    )


def _gpt_oss_tensors(model, reader) -> set[str]:
    """Load llama.cpp's gpt-oss tensors into `model`: those with standard names through the
    tensor names transformers maps, then each layer's attention sinks and experts, which
    llama.cpp stores as separate gate and up stacks [experts, out, in] where transformers
    holds one [experts, in, 2 * out] with gate and up interleaved. Returns the names of the
    weights filled."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from lmengine.engine.gguf_blocks import read_gguf_tensor

    tensors = {t.name: t for t in reader.tensors}
    values = {}
    for gguf_name, hf_name in get_gguf_hf_weights_map(model, TensorProcessor()).items():
        if gguf_name in tensors:
            values[hf_name] = read_gguf_tensor(tensors[gguf_name])

    def read(name: str) -> torch.Tensor:
        return read_gguf_tensor(tensors[name])

    def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.stack([gate, up], dim=-1).flatten(-2)  # g0 u0 g1 u1 ... on the last dim

    for i in range(model.config.num_hidden_layers):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        if blk + "ffn_gate_exps.weight" not in tensors:
            continue  # reported as unfilled
        values.update(
            {  # [heads]; [E, H, 2I]; [E, 2I]; [E, I, H]; [E, H]
                hf + "self_attn.sinks": read(blk + "attn_sinks.weight"),
                hf + "mlp.experts.gate_up_proj": interleave(
                    read(blk + "ffn_gate_exps.weight").transpose(1, 2),
                    read(blk + "ffn_up_exps.weight").transpose(1, 2),
                ),
                hf + "mlp.experts.gate_up_proj_bias": interleave(
                    read(blk + "ffn_gate_exps.bias"), read(blk + "ffn_up_exps.bias")
                ),
                hf + "mlp.experts.down_proj": read(blk + "ffn_down_exps.weight").transpose(1, 2),
                hf + "mlp.experts.down_proj_bias": read(blk + "ffn_down_exps.bias"),
            }
        )
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad():
        for name, value in values.items():
            if name in params and params[name].shape == value.shape:
                params[name].copy_(value)
                filled.add(name)
    return filled


def _load_gpt_oss(reader):
    """(the float32 model expanded from a gpt-oss file, names of the weights left unfilled)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_gpt_oss_config(reader), dtype=torch.float32)
    filled = _gpt_oss_tensors(model, reader)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    return model, set(dict(model.named_parameters())) - filled - tied


# GGUF architecture -> what puts back the settings its files leave out (see the module docstring)
GGUF_CONFIG_FIXES = {"gemma3": _gemma3_config, "qwen3moe": _qwen3moe_config}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize a GGUF checkpoint once into a float32 safetensors folder; return the folder.
    Raises ValueError for a file that cannot be expanded (`check_gguf_file`), and for one whose
    tensors do not fill every weight of the model."""
    from lmengine.engine.gguf_blocks import gguf_field

    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    reader = check_gguf_file(gguf_path)
    arch = gguf_field(reader, "general.architecture")
    logger.info("converting %s to safetensors in %s (once)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    with _reader_reused(gguf_path, reader):
        model, tokenizer = _expand(reader, arch, gguf_path, folder, name)
    _save_expanded(model, tokenizer, out_dir)
    return out_dir


@contextlib.contextmanager
def _reader_reused(path: Path, reader) -> Iterator[None]:
    """transformers opens the file once for the tokenizer, once for the config and once for
    the weights, and each `GGUFReader` parses every metadata field again (~5 s for a 49k
    vocabulary): while converting, opening `path` gives back the reader already open."""
    import gguf

    opened = gguf.GGUFReader

    def reuse(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == path:
            return reader
        return opened(file, *args, **kwargs)

    # NOTE: transformers imports the name from the module when it opens a file
    setattr(gguf, "GGUFReader", reuse)  # noqa: B010 - a class replaced by a function
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", opened)  # noqa: B010


def _expand(reader, arch: str, gguf_path: Path, folder: str, name: str):
    """The file's model in float32 and its tokenizer; ValueError when weights stay unfilled."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
    )

    if arch in ("gpt-oss", "deepseek2"):
        from lmengine.engine.gguf_deepseek2 import load_deepseek2

        if arch == "gpt-oss":
            model, unfilled = _load_gpt_oss(reader)
        else:
            model, unfilled = load_deepseek2(reader, gguf_path)
        # NOTE: AutoTokenizer would read the config through transformers' GGUF loader first
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        if arch in GGUF_CONFIG_FIXES:
            GGUF_CONFIG_FIXES[arch](config, reader)
        model, info = AutoModelForCausalLM.from_pretrained(  # type: ignore[misc]
            folder,
            gguf_file=name,
            config=config,
            dtype=torch.float32,
            ignore_mismatched_sizes=True,  # reported below, naming the weights
            output_loading_info=True,
        )
        unfilled = set(info["missing_keys"]) | {k[0] for k in info["mismatched_keys"]}  # type: ignore[has-type]
    if unfilled:
        names = sorted(unfilled)
        raise ValueError(
            f"{gguf_path}: the GGUF architecture {arch!r} is read, but {len(names)} weights of "
            "the model are filled from no tensor of the file, or from one of another shape "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): load the model's "
            "safetensors checkpoint instead"
        )
    return model, tokenizer


def _save_expanded(model, tokenizer, out_dir: Path) -> None:
    """Save the expanded model and tokenizer as `out_dir`, atomically (a rename)."""
    # NOTE: the weights are dequantized now; drop the GGUF marker so the folder saves and
    # loads as an ordinary float checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "config.json").exists():  # another process did not win the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
