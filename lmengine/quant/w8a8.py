"""W8A8 SmoothQuant: smoothing, conversion of a patched model, loading and making checkpoints.

Flow of `lmengine quantize w8a8` (`quantize_checkpoint`):
1. load the float model, unpatched, and run it on calibration text while hooks record the
   per-channel maxima of |input| of every linear of the decoder layers;
2. patch it (q/k/v and gate/up become MergedLinears) and smooth each layer: per input channel j
   of a linear group, `s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`; X is divided by s where it
   is produced (the RMSNorm weight for q/k/v and gate/up; the v rows of qkv for o; the up rows of
   gate_up for down), W's columns are multiplied by s. In float the model is unchanged; the
   activation outliers move into the weights, where per-channel quantization absorbs them.
   The v -> o and up -> down folds are optional (`fold_rows`): measured worse on SmolLM2;
3. replace the linears of the decoder layers with W8A8Linears (int8 weights per output
   channel), and the RMSNorms feeding them with W8A8RMSNorms (int8 activations per token);
4. save the patched state dict as safetensors; `config.json` records the quantization.

The LM head, the embeddings and the final norm stay in float. The checkpoint format is
`lmengine.quant.checkpoint`, the layouts of the architectures `lmengine.quant.layout`; their
names stay importable from here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from lmengine.models.llama import PatchedRMSNorm
from lmengine.models.patch import _import, qualname
from lmengine.models.w8a8 import W8A8_MODULE_MAP, W8A8Linear
from lmengine.quant.checkpoint import QUANT_METHOD as QUANT_METHOD  # re-exported
from lmengine.quant.checkpoint import build_skeleton as build_skeleton  # re-exported
from lmengine.quant.checkpoint import read_quant_config, save_quantized
from lmengine.quant.layout import W8A8_LAYOUTS as W8A8_LAYOUTS  # re-exported
from lmengine.quant.layout import W8A8Layout, get_layout

logger = logging.getLogger("lmengine")

_EPS = 1e-5


# ---- smoothing ----------------------------------------------------------------------------------


def smooth_scales(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """act_max [K], weight [N, K] -> s [K] = act_max^alpha / max_n |W[n, :]|^(1 - alpha)."""
    w_max = weight.detach().abs().amax(dim=0).float().clamp(min=_EPS)  # [K]
    a_max = act_max.float().to(weight.device).clamp(min=_EPS)
    return (a_max.pow(alpha) / w_max.pow(1.0 - alpha)).clamp(min=_EPS)


def _stat_key(layer_prefix: str, path: str, linear: nn.Module) -> str:
    """The name, in the unpatched model, of the HF linear whose input `linear` takes."""
    parent, _, _ = path.rpartition(".")
    names = getattr(linear, "source_names", None)
    if names:
        path = f"{parent}.{names[0]}" if parent else names[0]
    return f"{layer_prefix}.{path}"


def _part_rows(linear: nn.Module, part: str) -> slice:
    idx = linear.source_names.index(part)
    start = sum(linear.output_sizes[:idx])
    return slice(start, start + linear.output_sizes[idx])


@torch.no_grad()
def smooth_layer(
    layer: nn.Module,
    layer_prefix: str,
    layout: W8A8Layout,
    act_maxima: dict[str, torch.Tensor],
    alpha: float,
    head_dim: int,
    fold_rows: bool = False,
) -> None:
    """Fold SmoothQuant scales into one patched, still-float decoder layer (in place): into
    the norms always, into producer rows (v -> o, up -> down) only with `fold_rows`."""
    for norm_name, linear_name in layout.norm_groups:
        norm, linear = layer.get_submodule(norm_name), layer.get_submodule(linear_name)
        act = act_maxima[_stat_key(layer_prefix, linear_name, linear)]  # [hidden]
        s = smooth_scales(act, linear.weight, alpha)  # [hidden]
        norm.weight.div_(s.to(norm.weight.dtype))
        linear.weight.mul_(s.to(linear.weight.dtype)[None, :])
    for producer_name, part, consumer_name in layout.row_groups if fold_rows else ():
        producer = layer.get_submodule(producer_name)
        consumer = layer.get_submodule(consumer_name)
        rows = _part_rows(producer, part)
        num_rows = rows.stop - rows.start
        act = act_maxima[_stat_key(layer_prefix, consumer_name, consumer)]  # [consumer in]
        in_features = consumer.in_features
        # consumer column c reads producer row (c // (group * unit)) * unit + c % unit, where a
        # unit is one head (GQA: `group` query heads share one KV head) or all rows (SwiGLU)
        unit = num_rows if in_features == num_rows else head_dim
        if num_rows % unit or in_features % num_rows:
            logger.warning("w8a8: %s -> %s shapes do not fold; not smoothed", part, consumer_name)
            continue
        num_units, group = num_rows // unit, in_features // num_rows
        act_g = act.float().view(num_units, group, unit).amax(dim=1)  # [num_units, unit]
        w_g = consumer.weight.abs().amax(dim=0).float().view(num_units, group, unit).amax(dim=1)
        s = (act_g.clamp(min=_EPS).pow(alpha) / w_g.clamp(min=_EPS).pow(1 - alpha)).clamp(min=_EPS)
        producer.weight[rows].div_(s.reshape(-1, 1).to(producer.weight.dtype))
        if producer.bias is not None:
            producer.bias[rows].div_(s.reshape(-1).to(producer.bias.dtype))
        s_cols = s[:, None, :].expand(num_units, group, unit).reshape(-1)  # [in_features]
        consumer.weight.mul_(s_cols.to(consumer.weight.dtype)[None, :])
    for module in layer.modules():  # NOTE: packed weight copies are stale after the folds
        if hasattr(module, "repack"):
            module.repack()


# ---- conversion ---------------------------------------------------------------------------------


def convert_layer(layer: nn.Module, layout: W8A8Layout, quantize: bool = True) -> None:
    """Swap the linears of a patched decoder layer for W8A8Linears (quantizing their current
    weights unless `quantize` is False), its MLP for the W8A8 one and the norms that feed the
    linears for W8A8RMSNorms, through W8A8_MODULE_MAP."""
    for path, module in list(layer.named_modules()):
        target = W8A8_MODULE_MAP.get(qualname(type(module)))
        if target is None or not issubclass(_import(target), W8A8Linear):
            continue
        parent_path, _, name = path.rpartition(".")
        parent = layer.get_submodule(parent_path) if parent_path else layer
        setattr(parent, name, _import(target).from_float(module, quantize))
    for module in layer.modules():  # MLPs: a W8A8 forward on the same submodules
        target = W8A8_MODULE_MAP.get(qualname(type(module)))
        if target is not None and issubclass(_import(target), type(module)):
            if not isinstance(module, PatchedRMSNorm):  # norms: only those feeding int8
                module.__class__ = _import(target)
    for norm_name, _ in layout.norm_groups:
        norm = layer.get_submodule(norm_name)
        target = W8A8_MODULE_MAP.get(qualname(type(norm)))
        if target is None:
            raise ValueError(f"w8a8: no quantized replacement for {qualname(type(norm))}")
        norm.__class__ = _import(target)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    act_maxima: dict[str, torch.Tensor] | None = None,
    alpha: float | None = 0.5,
    quantize_weights: bool = True,
    fold_rows: bool = False,
) -> nn.Module:
    """Quantize a patched float model in place. With `act_maxima` (from calibration) and an
    `alpha`, SmoothQuant first; without, plain W8A8 (per-channel weights, per-token inputs).
    `quantize_weights=False` only builds the structure (to load a checkpoint into)."""
    layout = get_layout(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    config = config or model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for i, layer in enumerate(model.get_submodule(layout.layers)):
        if act_maxima is not None and alpha is not None:
            prefix = f"{layout.layers}.{i}"
            smooth_layer(layer, prefix, layout, act_maxima, alpha, head_dim, fold_rows)
        convert_layer(layer, layout, quantize_weights)
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, W8A8Linear) for m in model.modules())


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights (and scales, biases) of the decoder layers' linears."""
    layout = get_layout(model)
    total = 0
    for module in model.get_submodule(layout.layers).modules():
        if isinstance(module, (nn.Linear, W8A8Linear)):
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                total += t.numel() * t.element_size()
    return total


# ---- checkpoint ---------------------------------------------------------------------------------


@torch.no_grad()
def load_quantized(model: nn.Module, path: str | Path) -> nn.Module:
    """Convert a patched skeleton to w8a8 and load the checkpoint's tensors into it."""
    from safetensors.torch import load_file

    from lmengine.models.layers import PackedLinear

    quantize_model(model, None, None, quantize_weights=False)  # values come from the file
    device = next(model.parameters()).device
    state = load_file(str(Path(path) / "model.safetensors"), device=str(device))
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{path}: w8a8 checkpoint does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.repack()
    if (read_quant_config(path) or {}).get("lm_head") == "int8":
        quantize_lm_head(model)
    return model


def quantize_lm_head(model: nn.Module) -> None:
    """Run the LM head as a W8A8Linear quantized from its float weight (tied or not), per
    vocabulary row: a tensor-parallel rank's rows quantize exactly as they do in the whole
    model. The float module's hooks (the tensor-parallel logits gather) move to the new one;
    a tied embedding keeps its float weight for the lookups."""
    head = model.get_output_embeddings()
    if isinstance(head, W8A8Linear):
        return
    quantized = W8A8Linear.from_float(head)
    quantized._forward_pre_hooks.update(head._forward_pre_hooks)
    quantized._forward_hooks.update(head._forward_hooks)
    model.set_output_embeddings(quantized)


def check_engine_support(engine_config) -> None:
    """w8a8 with LoRA adapters is not implemented: say so at build. (tp > 1 loads a w8a8
    checkpoint in `lmengine.distributed.load`, never through here.)"""
    if engine_config.adapters:
        raise ValueError("quant_policy='w8a8' does not support LoRA adapters yet")


def apply_w8a8_policy(model: nn.Module, engine_config) -> nn.Module:
    """W8A8, by `apply_quant_policy`.

    - a w8a8 checkpoint (from `lmengine quantize w8a8`) loads its int8 weights, whatever
      `quant_policy` says;
    - a float checkpoint with `quant_policy="w8a8"` is quantized now, without calibration and
      hence without smoothing (lower quality: use `lmengine quantize w8a8` for SmoothQuant).
    """
    path = getattr(model, "lmengine_w8a8_checkpoint", None)
    if path is None and engine_config.quant_policy != "w8a8":
        return model
    check_engine_support(engine_config)
    if path is not None:
        return load_quantized(model, path)
    if is_quantized(model):
        return model
    logger.warning(
        "quant_policy='w8a8' on a float checkpoint: quantizing on load without calibration or "
        "smoothing; `lmengine quantize w8a8` makes a SmoothQuant checkpoint of better quality"
    )
    return quantize_model(model, None, None)


def calibrate(
    model: nn.Module,
    tokenizer,
    calib_samples: int = 64,
    calib_seqlen: int = 256,
    calib_text: str | None = None,
    show_progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Per-channel maxima of |input| of the decoder layers' linears of an unpatched float
    model, over `calib_samples` x `calib_seqlen` tokens of `calib_text` (default: stdlib docs)."""
    from lmengine.quant.calibration import calibration_batches, collect_input_maxima

    layout = get_layout(model)  # fail before the slow part
    batches = calibration_batches(tokenizer, calib_samples, calib_seqlen, calib_text)
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=calib_samples, desc="calibrating", unit="sample")
    try:
        return collect_input_maxima(
            model, batches, layout.layers, progress=bar.update if bar else None
        )
    finally:
        if bar is not None:
            bar.close()


def quantize_checkpoint(
    model_path: str | None,
    out_dir: str | Path,
    calib_samples: int = 64,
    calib_seqlen: int = 256,
    alpha: float | None = 0.5,
    calib_file: str | None = None,
    show_progress: bool = True,
    act_maxima: dict[str, torch.Tensor] | None = None,
    fold_rows: bool = False,
    int8_lm_head: bool = True,
) -> Path:
    """Calibrate, smooth, quantize and save; returns the output folder.

    alpha=None: no smoothing and no calibration (plain W8A8, for comparison). `act_maxima`
    from an earlier `calibrate` of the same model skips the calibration run. `fold_rows` also
    smooths o_proj and down_proj inputs into the v and up rows (off by default: on SmolLM2 it
    raised perplexity, see README). `int8_lm_head`: the checkpoint says to run the LM head
    in int8 too (per vocabulary row, activations per token, not smoothed; quantized from the
    float head when loaded, see `quantize_lm_head`).
    """
    from lmengine.engine.loader import load_model_and_tokenizer
    from lmengine.models import patch

    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    model, tokenizer, path, _ = load_model_and_tokenizer(model_path, "float32", "cpu")
    if read_quant_config(path) is not None:
        raise ValueError(f"{path} is already a w8a8 checkpoint")
    get_layout(model)  # fail before the slow part
    t0 = time.perf_counter()
    if alpha is not None and act_maxima is None:
        text = Path(calib_file).read_text(encoding="utf-8") if calib_file else None
        act_maxima = calibrate(
            model, tokenizer, calib_samples, calib_seqlen, text, show_progress=show_progress
        )
    calib_s = time.perf_counter() - t0
    patch(model)
    quantize_model(model, act_maxima, alpha, fold_rows=fold_rows)
    smoothed = alpha is not None
    folds = ["input_layernorm -> q/k/v", "post_attention_layernorm -> gate/up"]
    folds += ["v -> o", "up -> down"] if fold_rows else []
    quant_config = {
        "weights": "int8, symmetric, per output channel",
        "activations": "int8, symmetric, per token, dynamic",
        "smoothquant_alpha": alpha,
        "smoothing": folds if smoothed else [],
        "calib_samples": calib_samples if smoothed else 0,
        "calib_seqlen": calib_seqlen if smoothed else 0,
        "calib_source": (calib_file or "python stdlib docstrings") if smoothed else None,
        "calib_seconds": round(calib_s, 1),
        "source_model": str(path),
        "lm_head": "int8" if int8_lm_head else "float",
        "not_quantized": ["embeddings", "final norm"] + ([] if int8_lm_head else ["lm_head"]),
    }
    return save_quantized(model, tokenizer, out_dir, quant_config)
