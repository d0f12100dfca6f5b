"""A step's decoder layers as one compiled call (csrc/decode_loop_ops.cpp).

The kernels of a layer are short at a decode step and the Python around them (module calls,
argument checks, ~13 kernel calls per layer) is a large part of the step: a third of a
single-stream step on GGUF blocks, ~8 ms of a 64-row bfloat16 step of 64 ms on SmolLM2. And the
GIL is held between the kernels, where the server's threads wait for it and make the step wait
in turn, at prompt steps too. `run_decode_layers` runs the layers of a patched Llama-shaped
model in one native call instead, the GIL released throughout: the same kernels in the same
order with the same arguments (each linear on the route `kernels.linear.route` gives it for the
step's rows, each attention group on the compiled kernel `paged_attention_cpu` gives it), so
the hidden states are bit-identical to the modules' forward. It applies when

- every layer is the patched Llama layer as it is (fused q/k/v and gate/up, SwiGLU, full
  rotary, no q/k norm, sliding window or soft-cap, no LoRA, w8a8 or tensor-parallel wrapper,
  no forward hooks on any of its modules), with packed float32 or bfloat16 weights, or GGUF
  blocks of one type per linear;
- every attention group of the step has a compiled kernel here (decodes always; prompt chunks
  where the prefill kernel is built: AVX-512, and for bfloat16 the matrix units), no research
  hooks and a float cache; on GGUF blocks, a decode step of at most as many rows as their GEMV
  serves (8);
- the compiled kernels are built and `LMENGINE_DECODE_LOOP` is not `0`.

Anything else runs the modules. The loop holds references to the weights; it is rebuilt when a
module's class or a weight is replaced (LoRA, re-quantisation, loading new weights), which each
step checks (~15 us for SmolLM2's 30 layers).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import SiLUActivation

from lmengine.kernels import cpu_ext
from lmengine.kernels.gguf import MAX_GEMV_ROWS as _GGUF_GEMV_ROWS
from lmengine.kernels.linear import padded_rows, route
from lmengine.kernels.paged_attention import prefill_kernel
from lmengine.models.attention import PagedAttentionMixin
from lmengine.models.context import KeptRows, StepContext
from lmengine.models.layers import GGUFLinear, MergedLinear, PackedLinear

_FLOAT32, _BFLOAT16, _GGUF = 0, 1, 2  # DecodeLoop's weights kinds
_ACTIVATIONS = {_FLOAT32: torch.float32, _BFLOAT16: torch.bfloat16, _GGUF: torch.float32}


def is_enabled() -> bool:
    return os.environ.get("LMENGINE_DECODE_LOOP", "1") != "0"


class _Built:
    """A DecodeLoop over some layers and what it was built from: `still_valid` is True while
    every module has the class and the weights it had then.

    NOTE: both checks run at every step, so they are C-level passes over lists made here (~15
    us for SmolLM2's 270 modules; a Python loop over the modules took ~140)."""

    def __init__(
        self, loop, kind: int, modules: list[nn.Module], tensors: list, linears: list[nn.Module]
    ) -> None:
        self.loop, self.kind = loop, kind
        # the most rows a step may have to take the loop: GGUF blocks, what their GEMV serves
        self.max_rows = _GGUF_GEMV_ROWS if kind == _GGUF else None
        # the first layer's qkv, o, gate_up and down: every layer's take their routes
        self.linears = linears
        self.modules = modules
        self.classes = [type(m) for m in modules]
        # where each tensor the loop holds lives (`tensors`: (module, attribute, tensor)): a
        # module's _parameters or _buffers, which assigning a new weight updates in place, or
        # its __dict__ (a packed weight)
        self.stores = [_store_of(m, name) for m, name, _ in tensors]
        self.names = [name for _, name, _ in tensors]
        self.held = [t for _, _, t in tensors]
        self.hook_dicts = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]

    def still_valid(self) -> bool:
        if list(map(type, self.modules)) != self.classes:
            return False
        return all(map(operator.is_, map(dict.get, self.stores, self.names), self.held))

    def hooked(self) -> bool:
        """Whether a forward hook would see one of the modules (then the modules run)."""
        return _global_hooks() or any(self.hook_dicts)


def _global_hooks() -> bool:
    hooks = nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def any_forward_hooks(modules: Iterable[nn.Module]) -> bool:
    """Whether a forward hook, global or on one of `modules`, would see them run."""
    return _global_hooks() or any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _store_of(module: nn.Module, name: str) -> dict:
    """The dict of `module` that holds its parameter, buffer or plain attribute `name` (a
    packed weight: `PackedLinear.repack` assigns a new one)."""
    for store in (module._parameters, module._buffers):
        if name in store:
            return store
    return module.__dict__


@dataclass(frozen=True)
class LayerClasses:
    """The patched classes whose methods the loop stands in for (models/llama.py's)."""

    layer: type
    attention: type
    mlp: type
    norm: type


def run_decode_layers(
    layers: list[nn.Module],
    hidden_states: torch.Tensor,
    ctx: StepContext,
    owner: nn.Module,
    classes: LayerClasses,
    kept: KeptRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden states, residual) after `layers` in one compiled call, or None when this step or
    these layers do not take it (the caller then runs the modules). `owner` keeps the built
    loop between steps; a layer takes it only with `classes`' own methods. With `kept`, the
    last layer runs on the kept rows as PatchedLlamaDecoderLayer's forward does, and the
    result is those rows."""
    if not is_enabled() or ctx.hooks is not None or hidden_states.is_cuda:
        return None
    if ctx.cos is None or any(len(cache) != 2 for cache in ctx.kv_caches):
        return None  # no rotary, or an int8 cache (its scales ride along)
    built = owner.__dict__.get("_lmengine_decode_loop")
    if built is None or (built is not False and not built.still_valid()):
        built = _build(layers, classes) or False  # False: these layers never take it
        owner.__dict__["_lmengine_decode_loop"] = built
    if built is False or built.hooked() or not _step_fits(built, hidden_states, ctx):
        return None
    groups = _attention_groups(ctx, hidden_states.dtype, decode_only=built.kind == _GGUF)
    if groups is None:
        return None
    routes, padded = _routes(built, hidden_states.shape[0], hidden_states.dtype)
    kept_args: list[torch.Tensor] = []
    kept_routes, kept_padded = [0] * 4, 0
    if kept is not None and kept.meta is None:  # no row: the last layer's K and V alone
        none = torch.empty(0, dtype=torch.int32)
        kept_args = [kept.rows, none.view(0, 1), none]
    elif kept is not None:
        (plan,) = kept.meta.groups  # one decode group, every row of it
        kept_args = [kept.rows, plan.decode_tables, plan.decode_kv_lens]
        kept_routes, kept_padded = _routes(built, kept.rows.numel(), hidden_states.dtype)
    return built.loop.run(
        hidden_states,
        ctx.cos.contiguous(),
        ctx.sin.contiguous(),
        ctx.slot_mapping,
        *groups,
        [cache[0] for cache in ctx.kv_caches[: len(layers)]],
        [cache[1] for cache in ctx.kv_caches[: len(layers)]],
        routes,
        padded,
        kept_args,
        kept_routes,
        kept_padded,
    )


def _routes(built: _Built, rows: int, dtype: torch.dtype) -> tuple[list[int], int]:
    """The route of each of the four linears for `rows` rows, and the rows they compute."""
    if built.kind == _GGUF:
        return [0] * 4, rows
    routes = [route(rows, dtype, lin.in_features, lin.weight, lin.packed) for lin in built.linears]
    # NOTE: every linear of a step takes the same route here, so one row count serves them all
    return routes, padded_rows(rows, dtype, routes[0]) if len(set(routes)) == 1 else rows


def _attention_groups(
    ctx: StepContext, dtype: torch.dtype, decode_only: bool
) -> tuple[list[int], list[list[torch.Tensor]]] | None:
    """The step's attention groups as the loop takes them (kinds: 0 decodes, 1 prompt chunks;
    and each group's tensors, csrc/decode_loop_ops.cpp's Group), or None when a group has no
    compiled kernel here (then the modules run the step, on paged_attention_cpu's other
    paths). `decode_only`: only a step that is one decode group."""
    plans = ctx.attn_meta.groups
    if decode_only and (len(plans) != 1 or not plans[0].is_identity):
        return None
    kinds, tensors = [], []
    for plan in plans:
        if plan.decode_tables is not None:
            decode = [plan.decode_tables, plan.decode_kv_lens]
            if not plan.is_identity:
                decode += [plan.q_index[:, 0].contiguous(), plan.out_tokens]
            kinds.append(0)
            tensors.append(decode)
        elif plan.prefill_args is not None and not decode_only and prefill_kernel(dtype):
            kinds.append(1)
            tensors.append(list(plan.prefill_args))
        else:
            return None
    return kinds, tensors


def _step_fits(built: _Built, hidden_states: torch.Tensor, ctx: StepContext) -> bool:
    dtype = _ACTIVATIONS[built.kind]
    k_cache = ctx.kv_caches[0][0]
    rows = hidden_states.shape[0]
    return (
        rows >= 1
        and (built.max_rows is None or rows <= built.max_rows)
        and hidden_states.dtype == dtype
        and ctx.cos.dtype == dtype
        and k_cache.dtype == dtype
        and ctx.cos.shape[-1] == k_cache.shape[-1]  # full rotary
    )


def _build(layers: list[nn.Module], classes: LayerClasses) -> _Built | None:
    """The DecodeLoop of these layers, or None when some layer is not the plain patched Llama
    layer with weights the loop's kernels take."""
    ext = cpu_ext.load()
    if ext is None or not layers:
        return None
    kinds, modules, tensors, biases, qtypes, eps, scales = set(), [], [], [], [], set(), set()
    packed, shapes = [], set()  # shapes: what a linear's route depends on, per position
    for i, layer in enumerate(layers):
        if not same_methods(layer, classes.layer, "forward", "norm_input"):
            return None  # another layout: it may not even have these modules
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (
            same_methods(attn, classes.attention, "forward")
            and same_methods(attn, PagedAttentionMixin, "paged_attend", "norm_qk", "rotary")
            and same_methods(attn, PagedAttentionMixin, "rotate")
            and same_methods(attn, PagedAttentionMixin, "attention_sinks")
            and attn.layer_idx == i  # the loop hands layer i the i-th cache
            and attn.sliding_window is None
            and attn.attn_logit_softcapping is None
            and same_methods(mlp, classes.mlp, "forward", "act_mul", "fuses_silu_mul")
            and isinstance(mlp.act_fn, (SiLUActivation, nn.SiLU))
            and mlp.gate_up_proj.output_sizes[0] * 2 == mlp.gate_up_proj.out_features
            and all(same_methods(norm, classes.norm, "forward") for norm in norms)
            and len(attn.qkv_proj.output_sizes) == 3
        ):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for position, linear in enumerate(linears):
            kind = _linear_kind(linear)
            if kind is None:
                return None
            kinds.add(kind)
            name = "blocks0" if kind == _GGUF else "weight"
            tensors.append((linear, name, getattr(linear, name)))
            biases.append(linear.bias)
            qtypes.append(linear.qtypes[0] if kind == _GGUF else -1)
            pack = None if kind == _GGUF else linear.packed
            packed.append(pack)
            if pack is not None:
                tensors.append((linear, "packed", pack))
                shapes.add((position, linear.in_features, pack.dim(), pack.dtype))
        tensors += [(norm, "weight", norm.weight) for norm in norms]
        eps.update(norm.variance_epsilon for norm in norms)
        scales.add(attn.scaling)
        modules += [layer, attn, mlp, *norms, *linears]
    q_size, kv_size, _ = layers[0].self_attn.qkv_proj.output_sizes
    if len(kinds) != 1 or len(eps) != 1 or len(scales) != 1:
        return None
    if any(layer.self_attn.qkv_proj.output_sizes != [q_size, kv_size, kv_size] for layer in layers):
        return None
    if len(shapes) != len({position for position, *_ in shapes}):
        return None  # NOTE: one route per position serves every layer only if they agree
    (kind,) = kinds
    loop = ext.DecodeLoop(
        kind,
        [t for linear, name, t in tensors if name != "packed"],
        biases,
        qtypes,
        packed,
        eps.pop(),
        q_size,
        kv_size,
        scales.pop(),
    )
    first = layers[0]
    linears = [first.self_attn.qkv_proj, first.self_attn.o_proj, first.mlp.gate_up_proj]
    return _Built(loop, kind, modules, tensors, [*linears, first.mlp.down_proj])


def same_methods(module: nn.Module, cls: type, *names: str) -> bool:
    """`module`'s class has `cls`'s own `names` (a subclass may, as long as it overrides none)."""
    return isinstance(module, cls) and all(
        getattr(type(module), name) is getattr(cls, name) for name in names
    )


def _linear_kind(linear: nn.Module) -> int | None:
    """What the compiled loop runs this linear as, or None if it cannot (then the modules run)."""
    if type(linear) is GGUFLinear:
        return _GGUF if len(linear.qtypes) == 1 and linear.blocks0.is_contiguous() else None
    if type(linear) not in (PackedLinear, MergedLinear) or linear.packed is None:
        return None
    weight = linear.weight
    if not weight.is_contiguous() or weight.device.type != "cpu":
        return None
    if linear.bias is not None and linear.bias.dtype != weight.dtype:
        return None
    return {torch.float32: _FLOAT32, torch.bfloat16: _BFLOAT16}.get(weight.dtype)
