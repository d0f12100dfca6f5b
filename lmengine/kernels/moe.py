"""Mixture-of-experts feed-forward: every token runs through its top-k experts (gate/up, a gated
activation, then down, each GEMM with an optional per-expert bias), and the expert outputs are
summed with the router weights.

Weights as transformers 5 stores them for Mixtral and Qwen3-MoE: `w_gate_up` [num_experts,
2 * inter, hidden] (gate rows first, then up rows), `w_down` [num_experts, hidden, inter];
biases `b_gate_up` [num_experts, 2 * inter] and `b_down` [num_experts, hidden] (gpt-oss; a
patch converts its interleaved, transposed layout at load). Routing is the caller's: `topk_ids`
[num_tokens, top_k] int, `topk_weights` [num_tokens, top_k].

`act_fn` is either an activation of the gate, applied as act_fn(gate) * up (SiLU for Mixtral,
Qwen3-MoE and DeepSeek-V3), or a `GatedActivation` (kernels/activation.py), called as
act_fn(gate, up) (gpt-oss's ClampedSwiGLU): the isinstance test is the whole rule.

Paths with one signature: `fused_moe_ref` (dense per-slot gather, obviously right); on the CPU
the compiled layer (csrc/moe_ops.cpp: one call for all experts, float32 and bfloat16, SiLU,
GELU-tanh and ClampedSwiGLU) up to _LOOP_ROWS rows per expert on average, else (prompts, other
activations and dtypes, no compiled kernels) a Python loop over the experts that have tokens
(token slots sorted by expert, one GEMM pair per expert); on CUDA a Triton grouped GEMM over
the same expert-sorted order (lmengine.kernels.triton.moe).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext
from lmengine.kernels.activation import ClampedSwiGLU, GatedActivation, gated
from lmengine.kernels.linear import linear, pack_weight

ActFn = Callable[[torch.Tensor], torch.Tensor] | GatedActivation

# the activation codes of csrc/moe_ops.cpp
_SILU, _GELU_TANH, _CLAMPED_SWIGLU = 0, 1, 2
# Rows of one bfloat16 expert from which the compiled layer runs its GEMMs on AMX tiles (where
# built) instead of dot products: one row streams faster through the dot products (Qwen3-MoE's
# layer at 1 token: 3.9 ms on the tiles from 1 row, 3.1 from 2), from two the tiles win
_AMX_ROWS = 2
# From this many rows per expert on average (prompts: 1,024 tokens of Qwen3-MoE, 256 of
# Mixtral) the Python loop's per-expert GEMMs (MKL, oneDNN) beat the compiled layer, whose
# kernels are built for streaming the weights. Qwen3-MoE's shape, one thread, ms at 16 / 32 /
# 64 / 128 rows: float32 compiled 369 / 603 / 1,047, loop 623 / 707 / 1,002; bfloat16 173 /
# 256 / 394 / 715 against 210 / 261 / 385 / 537
_LOOP_ROWS = 64


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: ActFn,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [num_tokens, hidden] -> [num_tokens, hidden]. Gathers each slot's expert weights
    per token (memory heavy: for tests)."""
    out = torch.zeros_like(x)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot]
        gate_up = torch.bmm(w_gate_up[ids], x[:, :, None])[..., 0]  # [num_tokens, 2 * inter]
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[ids]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.bmm(w_down[ids], gated(act_fn, gate, up)[:, :, None])[..., 0]  # [n, hidden]
        if b_down is not None:
            y = y + b_down[ids]
        out += topk_weights[:, slot, None].to(x.dtype) * y
    return out


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Slots (token * top_k + k) ordered by expert, and how many slots each expert has."""
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # [num_tokens * top_k]
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts.tolist()


def pack_experts(w: torch.Tensor) -> list[torch.Tensor | None] | None:
    """What the CPU path wants prepared once at load for the experts' [num_experts, out, in]
    matrix `w`: None where the compiled layer runs them (it reads the weights as stored, and
    prompts go to the Python loop on them too: packed copies would double the experts' memory
    for ~10 % on float32 prompts), else packed copies of each expert's matrix for the Python
    loop (MKL's or oneDNN's: kernels/linear.py), or None where packing does not apply."""
    if _compiled_takes_weights(w):
        return None
    packed = [pack_weight(w[e]) for e in range(w.shape[0])]
    return None if any(p is None for p in packed) else packed


def fused_moe_cpu(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: ActFn,
    packed: tuple[list, list] | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Python loop: one gather of the token rows in expert order, then one GEMM pair per
    expert over its contiguous run of rows, one weighted scatter-add back. `packed`:
    (pack_experts(w_gate_up), pack_experts(w_down)), for GEMMs on packed weights."""
    num_tokens, top_k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w_gate_up.shape[0])
    token = order // top_k  # [num_slots] token of each sorted slot
    rows = x.index_select(0, token)  # [num_slots, hidden]
    packed_gate_up, packed_down = packed or (None, None)
    outs = []
    for expert, part in enumerate(rows.split(counts)):
        if part.shape[0] == 0:
            continue
        pgu = packed_gate_up[expert] if packed_gate_up else None
        pd = packed_down[expert] if packed_down else None
        bgu = None if b_gate_up is None else b_gate_up[expert]
        bd = None if b_down is None else b_down[expert]
        gate, up = linear(part, w_gate_up[expert], bgu, pgu).chunk(2, dim=-1)  # [n, inter]
        outs.append(linear(gated(act_fn, gate, up), w_down[expert], bd, pd))  # [n, hidden]
    y = torch.cat(outs) * topk_weights.flatten()[order, None].to(x.dtype)  # [num_slots, hidden]
    return torch.zeros_like(x).index_add_(0, token, y)


def native_activation(act_fn: ActFn) -> tuple[int, float, float] | None:
    """(code, alpha, limit) of an activation the compiled layer computes itself, else None:
    SiLU (F.silu, nn.SiLU, transformers' SiLUActivation), GELU with the tanh approximation
    (nn.GELU("tanh"), partial(F.gelu, approximate="tanh"), transformers' GELUTanh) and
    ClampedSwiGLU. Exact types only: a subclass may compute something else."""
    if type(act_fn) is ClampedSwiGLU:
        return _CLAMPED_SWIGLU, act_fn.alpha, act_fn.limit
    if act_fn is F.silu or type(act_fn) is torch.nn.SiLU:
        return _SILU, 0.0, 0.0
    if type(act_fn) is torch.nn.GELU and act_fn.approximate == "tanh":
        return _GELU_TANH, 0.0, 0.0
    if (
        isinstance(act_fn, functools.partial)
        and act_fn.func is F.gelu
        and not act_fn.args
        and act_fn.keywords == {"approximate": "tanh"}
    ):
        return _GELU_TANH, 0.0, 0.0
    # NOTE: transformers' classes by name: kernels import only torch and triton
    name = f"{type(act_fn).__module__}.{type(act_fn).__qualname__}"
    if name == "transformers.activations.SiLUActivation":
        return _SILU, 0.0, 0.0
    if name == "transformers.activations.GELUTanh":  # its `act` says which formula it runs
        inner = getattr(act_fn, "act", None)
        return None if inner is None else native_activation(inner)
    return None


def _compiled_takes_weights(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype in (torch.float32, torch.bfloat16)
        and w.is_contiguous()
        and cpu_ext.load() is not None
    )


def fused_moe_compiled(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: ActFn,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    amx_rows: int = _AMX_ROWS,
    use_bf16_units: bool = True,
) -> torch.Tensor | None:
    """The compiled layer (csrc/moe_ops.cpp), or None where it does not apply: the kernels not
    built, a dtype other than float32 / bfloat16 or mixed dtypes, non-contiguous weights, an
    activation it does not compute (`native_activation`). `amx_rows` and `use_bf16_units`
    steer its kernels (tests reach each one through them)."""
    act = native_activation(act_fn)
    if act is None or not _compiled_takes_weights(w_gate_up):
        return None
    others = [t for t in (w_down, b_gate_up, b_down) if t is not None]
    if any(t.dtype != w_gate_up.dtype or not t.is_contiguous() for t in others):
        return None
    if x.dtype != w_gate_up.dtype or x.device.type != "cpu":
        return None
    module = cpu_ext.load()
    assert module is not None  # NOTE: checked by _compiled_takes_weights
    code, alpha, limit = act
    return module.fused_moe(
        x.contiguous(),
        w_gate_up,
        w_down,
        b_gate_up,
        b_down,
        topk_weights.to(torch.float32).contiguous(),
        topk_ids.to(torch.int64).contiguous(),
        code,
        alpha,
        limit,
        amx_rows,
        use_bf16_units,
    )


def _check(x, w_gate_up, w_down, topk_weights, topk_ids, b_gate_up, b_down) -> None:
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            "fused_moe: x must be [num_tokens, hidden], w_gate_up [experts, 2 * inter, hidden], "
            f"w_down [experts, hidden, inter]; got {tuple(x.shape)}, {tuple(w_gate_up.shape)}, "
            f"{tuple(w_down.shape)}"
        )
    num_experts, two_inter, hidden = w_gate_up.shape
    if x.shape[1] != hidden or tuple(w_down.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"fused_moe: shapes do not fit: x {tuple(x.shape)}, w_gate_up "
            f"{tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [num_tokens={x.shape[0]}, top_k]"
        )
    for name, bias, shape in (
        ("b_gate_up", b_gate_up, (num_experts, two_inter)),
        ("b_down", b_down, (num_experts, hidden)),
    ):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"fused_moe: {name} must be {shape}, got {tuple(bias.shape)}")


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: ActFn,
    packed: tuple[list, list] | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [num_tokens, hidden] -> sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x), an
    expert being down(gated(act_fn, gate_up(x) + b_gate_up) + b_down. An id of -1 is no
    expert: the slot adds nothing (under tensor parallelism, the slots of experts another rank
    holds). `packed`: what pack_experts prepared for the CPU path (None is fine: the compiled
    layer needs nothing)."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids, b_gate_up, b_down)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    args = (x, w_gate_up, w_down, topk_weights, topk_ids, act_fn)
    num_tokens, top_k = topk_ids.shape
    if not x.is_cuda and num_tokens * top_k < _LOOP_ROWS * w_gate_up.shape[0]:
        out = fused_moe_compiled(*args, b_gate_up=b_gate_up, b_down=b_down)
        if out is not None:  # the compiled layer leaves the slots of id -1 out itself
            return out
    none = topk_ids < 0
    if bool(none.any()):  # the other paths: such a slot runs expert 0 with weight 0
        topk_weights = topk_weights.masked_fill(none, 0.0)
        args = (x, w_gate_up, w_down, topk_weights, topk_ids.clamp_min(0), act_fn)
    if x.is_cuda:
        from lmengine.kernels.triton.moe import fused_moe_triton

        return fused_moe_triton(*args, b_gate_up=b_gate_up, b_down=b_down)
    return fused_moe_cpu(*args, packed, b_gate_up=b_gate_up, b_down=b_down)
