"""Mixture-of-experts feed-forward: every token runs through its top-k experts (SwiGLU-style
gate/up then down), and the expert outputs are summed with the router weights.

Weights as transformers 5 stores them for Mixtral: `w_gate_up` [num_experts, 2 * inter, hidden]
(gate rows first, then up rows), `w_down` [num_experts, hidden, inter]. Routing is the caller's:
`topk_ids` [num_tokens, top_k] int, `topk_weights` [num_tokens, top_k].

Three paths with one signature: `fused_moe_ref` (dense per-slot gather, obviously right), the CPU
path (token slots sorted by expert, one GEMM pair per expert that has tokens) and, on CUDA, a
Triton grouped GEMM over the same expert-sorted order (lmengine.kernels.triton.moe).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmengine.kernels.linear import linear, pack_weight


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x: [num_tokens, hidden] -> [num_tokens, hidden]. Gathers each slot's expert weights
    per token (memory heavy: for tests)."""
    out = torch.zeros_like(x)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot]
        gate_up = torch.bmm(w_gate_up[ids], x[:, :, None])[..., 0]  # [num_tokens, 2 * inter]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.bmm(w_down[ids], (act_fn(gate) * up)[:, :, None])[..., 0]  # [num_tokens, hidden]
        out += topk_weights[:, slot, None].to(x.dtype) * y
    return out


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """Slots (token * top_k + k) ordered by expert, and how many slots each expert has."""
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # [num_tokens * top_k]
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts.tolist()


def pack_experts(w: torch.Tensor) -> list[torch.Tensor | None] | None:
    """Packed copies of each expert's [out, in] matrix (MKL's or oneDNN's: kernels/linear.py),
    or None where packing does not apply."""
    packed = [pack_weight(w[e]) for e in range(w.shape[0])]
    return None if any(p is None for p in packed) else packed


def fused_moe_cpu(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    packed: tuple[list, list] | None = None,
) -> torch.Tensor:
    """Grouped by expert: one gather of the token rows in expert order, then one GEMM pair
    per expert over its contiguous run of rows, one weighted scatter-add back. `packed`:
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
        gate, up = linear(part, w_gate_up[expert], None, pgu).chunk(2, dim=-1)  # [n, inter]
        outs.append(linear(act_fn(gate) * up, w_down[expert], None, pd))  # [n, hidden]
    y = torch.cat(outs) * topk_weights.flatten()[order, None].to(x.dtype)  # [num_slots, hidden]
    return torch.zeros_like(x).index_add_(0, token, y)


def _check(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
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


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    packed: tuple[list, list] | None = None,
) -> torch.Tensor:
    """x: [num_tokens, hidden] -> sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x).
    `packed`: optional per-expert packed weights for the CPU path."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if x.is_cuda:
        from lmengine.kernels.triton.moe import fused_moe_triton

        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, act_fn)
    return fused_moe_cpu(x, w_gate_up, w_down, topk_weights, topk_ids, act_fn, packed)
