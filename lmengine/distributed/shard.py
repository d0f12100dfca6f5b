"""Sharding a patched model over tensor-parallel ranks, and loading each rank's slices only.

The sharding is declared by the model, not by the agent: the plan is HF's own
`base_model_tp_plan` of the config (module-name patterns -> "colwise" / "rowwise", the same
plan transformers uses for its tensor parallelism), or a patched top-level class's
`lmengine_tp_plan` when it defines one. So an architecture whose HF config carries a plan gets
tensor parallelism without code. Applied to the patched modules:

- colwise: output rows split. A `MergedLinear` (q/k/v, gate/up) is split per part and
  restacked, so `split()` still cuts it right. Inside a module with `head_dim` (attention) the
  unit is a head; when there are fewer heads than ranks (KV heads), ranks share a head.
- rowwise: input columns split, the output is summed over ranks (all-reduce); the bias is
  added by rank 0 only.
- the input embedding and the LM head are always vocabulary-parallel: each rank holds
  ceil(vocab / tp) rows; embedding rows outside a rank's range are zero and summed; the LM
  head's logit shards are gathered to rank 0.
- experts (transformers' 3-D expert parameters) are split by expert: each rank holds E / tp
  whole experts, the block routes over all of them, runs its own and sums over ranks.
- everything else (norms, routers) is replicated.
- w8a8 (`W8A8Linear`, int8 weights with a float32 scale per output row): colwise splits the
  int8 rows with their scales; rowwise splits the int8 input columns and keeps the scales
  and bias whole; a rowwise layer takes its per-token input scale over all ranks and sums
  the int32 accumulators (exact), so it computes what tp=1 does.

`shard_model` only reshapes parameters (on the meta device) and records where each one's
values come from; `CheckpointReader` then reads exactly those slices from the safetensors
files, so a rank never holds the full weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from lmengine.distributed.comm import all_reduce, gather_vocab
from lmengine.models.layers import MergedLinear
from lmengine.models.w8a8 import W8A8Linear


@dataclass(frozen=True)
class Piece:
    """One slice of one checkpoint tensor; a parameter is its pieces stacked along dim 0."""

    key: str | None  # checkpoint tensor name; None = zeros of `stop - start` rows
    dim: int | None  # dimension sliced; None = the whole tensor
    start: int = 0
    stop: int = 0
    pad: int = 0  # zero rows appended along dim 0 (padding of the last vocabulary shard)
    missing_is_zero: bool = False  # a merged part without a bias: zeros of `stop - start`


LoadPlan = dict[str, list[Piece]]  # parameter or buffer name -> pieces


@dataclass(frozen=True)
class TPShard:
    """How one linear was split, kept on it (`lmengine_tp_shard`) for whoever shards tensors
    that pair with its weight (LoRA A and B)."""

    style: str  # "colwise" (output rows split) or "rowwise" (input columns split)
    full_sizes: tuple[int, ...]  # colwise: full output rows of each part; rowwise: (full in,)
    # colwise: this rank's rows of each part, counted from the part's first row for a
    # MergedLinear, from the tensor's for a linear fused in the checkpoint (Phi-3's qkv_proj);
    # rowwise: ((first, stop) input column,)
    ranges: tuple[tuple[int, int], ...]


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Full module-name pattern -> style ("colwise" / "rowwise"), declared by the model."""
    own = getattr(type(model), "lmengine_tp_plan", None)
    if own is not None:
        return dict(own)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    base = getattr(config or model.config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    plan = {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
    if not plan:
        raise ValueError(
            f"{type(model).__name__} declares no tensor-parallel plan (no base_model_tp_plan "
            "in its config): give the patched class an `lmengine_tp_plan` to use tp > 1"
        )
    return plan


def _style(style: str) -> str:
    """HF style names -> the two this module applies."""
    if "colwise" in style:
        return "colwise"
    if "rowwise" in style:
        return "rowwise"
    raise ValueError(f"tensor-parallel style {style!r} is not supported for a linear layer")


class _PlanMatcher:
    def __init__(self, plan: dict[str, str]) -> None:
        self.rules = [
            (re.compile(re.escape(pattern).replace(r"\*", r"\d+")), style)
            for pattern, style in plan.items()
        ]

    def style(self, name: str) -> str | None:
        for regex, style in self.rules:
            if regex.fullmatch(name):
                return _style(style)
        return None


def unit_range(
    num_units: int, unit: int, rank: int, tp: int, what: str, can_share: bool
) -> tuple[int, int]:
    """Rows [start, stop) of this rank's share of `num_units` units of `unit` rows each.

    With fewer units than ranks and `can_share` (KV heads), ranks share one unit each.
    """
    if num_units % tp == 0:
        per = num_units // tp
        return rank * per * unit, (rank + 1) * per * unit
    if can_share and tp % num_units == 0:
        u = rank * num_units // tp
        return u * unit, (u + 1) * unit
    raise ValueError(f"tp={tp} cannot split {what} ({num_units}) evenly over the ranks")


def _meta_param(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device="meta"), requires_grad=False)


def _vocab_range(vocab: int, rank: int, tp: int) -> tuple[int, int, int]:
    """(start, stop, pad) of this rank's vocabulary rows; every shard has ceil(vocab/tp) rows."""
    per = math.ceil(vocab / tp)
    start = min(rank * per, vocab)
    stop = min(start + per, vocab)
    return start, stop, per - (stop - start)


def _add_vocab_parallel_embedding(module: nn.Embedding, start: int, stop: int) -> None:
    """Rows outside [start, stop) read row 0 and are zeroed; the sum over ranks is the lookup."""

    def before(mod: nn.Module, args: tuple):
        ids = args[0]
        mod.lmengine_outside = (ids < start) | (ids >= stop)  # [num_tokens]
        return ((ids - start).masked_fill(mod.lmengine_outside, 0), *args[1:])

    def after(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(mod.lmengine_outside.unsqueeze(-1), 0)  # [num_tokens, hidden]
        return all_reduce(out)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _add_all_reduce(module: nn.Module) -> None:
    module.register_forward_hook(lambda mod, args, out: all_reduce(out))


def _add_gather_vocab(module: nn.Module, vocab: int) -> None:
    module.register_forward_hook(lambda mod, args, out: gather_vocab(out, vocab))


def shard_model(model: nn.Module, rank: int, tp: int) -> LoadPlan:
    """Reshape the (meta) parameters of a patched model to rank `rank`'s shard, install the
    communication hooks, and return where every parameter's values come from."""
    matcher = _PlanMatcher(tp_plan(model))
    modules = dict(model.named_modules())
    load: LoadPlan = {}
    handled: set[int] = set()
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    is_tied = head is not None and head.weight is emb.weight
    names = {id(m): n for n, m in modules.items()}

    # vocabulary-parallel embedding and LM head
    vocab = emb.num_embeddings
    start, stop, pad = _vocab_range(vocab, rank, tp)
    emb_name = names[id(emb)]
    emb.weight = _meta_param((stop - start + pad, emb.embedding_dim), emb.weight)
    load[f"{emb_name}.weight"] = [Piece(f"{emb_name}.weight", 0, start, stop, pad)]
    _add_vocab_parallel_embedding(emb, start, stop)
    handled.add(id(emb))
    if head is not None:
        head_name = names[id(head)]
        if head.bias is not None:
            raise ValueError("an LM head with a bias is not supported with tp > 1")
        if is_tied:
            head.weight = emb.weight
        else:
            head.weight = _meta_param((stop - start + pad, head.in_features), head.weight)
            load[f"{head_name}.weight"] = [Piece(f"{head_name}.weight", 0, start, stop, pad)]
        head.out_features = stop - start + pad
        _add_gather_vocab(head, vocab)
        handled.add(id(head))

    for name, module in modules.items():
        if id(module) in handled:
            continue
        parent_name = name.rpartition(".")[0]
        unit = getattr(modules[parent_name], "head_dim", 1) if name else 1
        if _is_experts(module):
            _shard_experts(module, name, modules[parent_name], rank, tp, load)
        elif isinstance(module, W8A8Linear):
            _shard_w8a8(module, name, parent_name, matcher, unit, rank, tp, load)
        elif isinstance(module, MergedLinear):
            _shard_merged(module, name, parent_name, matcher, unit, rank, tp, load)
        elif isinstance(module, nn.Linear):
            _shard_linear(module, name, matcher.style(name), unit, rank, tp, load)
        else:
            for pname, _ in module.named_parameters(recurse=False):
                load[f"{name}.{pname}"] = [Piece(f"{name}.{pname}", None)]
        # persistent buffers a checkpoint may hold (DeepSeek's routing correction bias)
        for bname, _ in module.named_buffers(recurse=False):
            key = _prefixed(name, bname)
            if bname not in module._non_persistent_buffers_set and key not in load:
                load[key] = [Piece(key, None)]
    return load


def _is_experts(module: nn.Module) -> bool:
    """transformers' experts as 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj`)."""
    weight = getattr(module, "gate_up_proj", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 3


def _shard_experts(
    module: nn.Module, name: str, block: nn.Module, rank: int, tp: int, load: LoadPlan
) -> None:
    """Each rank holds E / tp whole experts (every parameter whose first dimension counts
    experts: weights, biases). The block routes over all experts, runs its own and sums over
    ranks; with E not divisible by tp every rank holds them all."""
    num_experts = module.gate_up_proj.shape[0]
    start, stop = 0, num_experts
    if num_experts % tp == 0:
        start, stop = rank * num_experts // tp, (rank + 1) * num_experts // tp
        block.lmengine_expert_range = (start, stop)  # the block sums its experts over ranks
    for pname, param in module.named_parameters(recurse=False):
        key = f"{name}.{pname}"
        if param.shape[0] == num_experts and (start, stop) != (0, num_experts):
            setattr(module, pname, _meta_param((stop - start, *param.shape[1:]), param))
            load[key] = [Piece(key, 0, start, stop)]
        else:
            load[key] = [Piece(key, None)]


def _prefixed(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _shard_merged(
    module: MergedLinear,
    name: str,
    parent: str,
    matcher: _PlanMatcher,
    unit: int,
    rank: int,
    tp: int,
    load: LoadPlan,
) -> None:
    """Split each stacked part (q, k, v or gate, up) on its own, then restack."""
    parts = [_prefixed(parent, src) for src in module.source_names]
    styles = {matcher.style(p) for p in parts}
    weight_pieces, bias_pieces, sizes = [], [], []
    if styles == {None}:  # replicated
        for part, size in zip(parts, module.output_sizes):
            weight_pieces.append(Piece(f"{part}.weight", None))
            bias_pieces.append(Piece(f"{part}.bias", None, 0, size, missing_is_zero=True))
            sizes.append(size)
    elif styles == {"colwise"}:
        for part, size in zip(parts, module.output_sizes):
            what = f"the {size // unit} {'heads' if unit > 1 else 'rows'} of {part}"
            a, b = unit_range(size // unit, unit, rank, tp, what, can_share=unit > 1)
            weight_pieces.append(Piece(f"{part}.weight", 0, a, b))
            bias_pieces.append(Piece(f"{part}.bias", 0, a, b, missing_is_zero=True))
            sizes.append(b - a)
    else:
        raise ValueError(f"the parts {parts} of one merged linear must all be colwise")
    if styles == {"colwise"}:
        ranges = tuple((p.start, p.stop) for p in weight_pieces)
        module.lmengine_tp_shard = TPShard("colwise", tuple(module.output_sizes), ranges)
    module.weight = _meta_param((sum(sizes), module.in_features), module.weight)
    module.out_features = sum(sizes)
    module.output_sizes = sizes
    load[f"{name}.weight"] = weight_pieces
    if module.bias is not None:
        # NOTE: MergedLinear gives parts without a bias zero rows; so does the reader
        module.bias = _meta_param((sum(sizes),), module.bias)
        load[f"{name}.bias"] = bias_pieces


def _shard_linear(
    module: nn.Linear,
    name: str,
    style: str | None,
    unit: int,
    rank: int,
    tp: int,
    load: LoadPlan,
) -> None:
    if style is None:
        for pname, _ in module.named_parameters(recurse=False):
            load[f"{name}.{pname}"] = [Piece(f"{name}.{pname}", None)]
        return
    if style == "colwise":
        # a linear fused in the checkpoint (Phi-3's qkv_proj, gate_up_proj) is split part by
        # part, as a MergedLinear is: each rank takes its heads of q, of k and of v
        full_sizes = getattr(module, "output_sizes", None) or [module.out_features]
        ranges, sizes, offset = [], [], 0
        for i, size in enumerate(full_sizes):
            part = f"{name} (part {i})" if len(full_sizes) > 1 else name
            what = f"the {size // unit} {'heads' if unit > 1 else 'rows'} of {part}"
            a, b = unit_range(size // unit, unit, rank, tp, what, can_share=unit > 1)
            ranges.append((offset + a, offset + b))
            sizes.append(b - a)
            offset += size
        module.lmengine_tp_shard = TPShard("colwise", tuple(full_sizes), tuple(ranges))
        rows = sum(sizes)
        module.weight = _meta_param((rows, module.in_features), module.weight)
        load[f"{name}.weight"] = [Piece(f"{name}.weight", 0, a, b) for a, b in ranges]
        if module.bias is not None:
            module.bias = _meta_param((rows,), module.bias)
            load[f"{name}.bias"] = [Piece(f"{name}.bias", 0, a, b) for a, b in ranges]
        module.out_features = rows
        if len(full_sizes) > 1:
            module.output_sizes = sizes
        return
    size = module.in_features
    what = f"the {size // unit} input {'heads' if unit > 1 else 'columns'} of {name}"
    a, b = unit_range(size // unit, unit, rank, tp, what, can_share=False)
    module.lmengine_tp_shard = TPShard("rowwise", (size,), ((a, b),))
    module.weight = _meta_param((module.out_features, b - a), module.weight)
    load[f"{name}.weight"] = [Piece(f"{name}.weight", 1, a, b)]
    if module.bias is not None:
        if rank == 0:  # NOTE: summed over ranks, so only one rank adds the bias
            load[f"{name}.bias"] = [Piece(f"{name}.bias", None)]
        else:
            module.bias = None
    module.in_features = b - a
    _add_all_reduce(module)


def _meta_buffer(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device="meta")


def _shard_w8a8(
    module: W8A8Linear,
    name: str,
    parent: str,
    matcher: _PlanMatcher,
    unit: int,
    rank: int,
    tp: int,
    load: LoadPlan,
) -> None:
    """A w8a8 checkpoint stores a merged linear as one tensor (the patched model's names), so
    a part's rows are a range of it. colwise: the int8 rows, their scales and bias rows split
    per part; rowwise: the int8 input columns split, scales whole (per output channel), bias
    whole, the per-token input scale taken over every rank's shard and the int32 accumulators
    summed before the epilogue (`RowParallelW8A8Linear`)."""
    from lmengine.distributed.w8a8 import RowParallelW8A8Linear

    names = module.source_names or [name.rpartition(".")[2]]
    parts = [_prefixed(parent, src) for src in names]
    styles = {matcher.style(p) for p in parts}
    buffers = [b for b in ("weight", "weight_scale", "bias") if getattr(module, b) is not None]
    if styles == {None}:
        for b in buffers:
            load[f"{name}.{b}"] = [Piece(f"{name}.{b}", None)]
        return
    if styles == {"colwise"}:
        ranges = []
        for part, size in zip(parts, module.output_sizes):
            what = f"the {size // unit} {'heads' if unit > 1 else 'rows'} of {part}"
            ranges.append(unit_range(size // unit, unit, rank, tp, what, can_share=unit > 1))
        starts = [sum(module.output_sizes[:i]) for i in range(len(parts))]
        for b in buffers:
            load[f"{name}.{b}"] = [
                Piece(f"{name}.{b}", 0, s + a, s + e) for s, (a, e) in zip(starts, ranges)
            ]
        module.lmengine_tp_shard = TPShard("colwise", tuple(module.output_sizes), tuple(ranges))
        sizes = [e - a for a, e in ranges]
        for b in buffers:
            t = getattr(module, b)
            setattr(module, b, _meta_buffer((sum(sizes), *t.shape[1:]), t))
        module.out_features, module.output_sizes = sum(sizes), sizes
        return
    if styles != {"rowwise"} or len(parts) != 1:
        raise ValueError(f"the parts {parts} of one merged linear must all be colwise")
    size = module.in_features
    what = f"the {size // unit} input {'heads' if unit > 1 else 'columns'} of {name}"
    a, b = unit_range(size // unit, unit, rank, tp, what, can_share=False)
    module.lmengine_tp_shard = TPShard("rowwise", (size,), ((a, b),))
    module.weight = _meta_buffer((module.out_features, b - a), module.weight)
    load[f"{name}.weight"] = [Piece(f"{name}.weight", 1, a, b)]
    load[f"{name}.weight_scale"] = [Piece(f"{name}.weight_scale", None)]
    if module.bias is not None:  # NOTE: added after the sum, by every rank
        load[f"{name}.bias"] = [Piece(f"{name}.bias", None)]
    module.in_features = b - a
    RowParallelW8A8Linear.convert(module)  # it all-reduces its int32 accumulator itself
