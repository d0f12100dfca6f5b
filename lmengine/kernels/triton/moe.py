"""Triton grouped GEMM for mixture-of-experts layers.

The (token, k) slots are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M (`align_by_expert`), so every BLOCK_M-row tile belongs to one expert. One kernel,
launched twice, computes `c[slot] = a[slot // A_ROW_DIV] @ w[expert]^T (+ bias[expert])` for
the rows of a tile: first x -> gate/up (A_ROW_DIV = top_k: the slot's token row), then the
activated product -> down, scaled by the router weight of the slot (MUL_WEIGHT). Padding slots
hold the sentinel `num_slots` and are masked. The top-k outputs of a token are summed at the
end; the activation between the two runs in torch (`gated`: act(gate) * up, or a
GatedActivation's act(gate, up)).

Layouts: a [rows, K] with a contiguous last dim, w [num_experts, N, K] (an nn.Linear weight per
expert, as transformers stores Mixtral's experts), c [num_slots, N].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from lmengine.kernels.activation import GatedActivation, gated


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]
    w_ptr,  # [num_experts, N, K]
    bias_ptr,  # [num_experts, N] (used when HAS_BIAS)
    c_ptr,  # [num_slots, N]
    sorted_slots_ptr,  # [num_padded] int64, slot ids in expert order; num_slots = padding
    tile_expert_ptr,  # [num_padded // BLOCK_M] int64, expert of each row tile
    weights_ptr,  # [num_slots] router weight of each slot (used when MUL_WEIGHT)
    num_slots,
    N,
    K,
    stride_a_m,
    stride_w_e,
    stride_w_n,
    stride_bias_e,
    stride_c_m,
    A_ROW_DIV: tl.constexpr,  # a row of slot s is s // A_ROW_DIV
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    slots = tl.load(sorted_slots_ptr + offs_m)  # [BLOCK_M]
    row_valid = slots < num_slots  # [BLOCK_M]
    a_rows = tl.where(row_valid, slots // A_ROW_DIV, 0)  # [BLOCK_M]
    expert = tl.load(tile_expert_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_valid = offs_n < N  # [BLOCK_N]
    w_base = w_ptr + expert * stride_w_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_valid = offs_k < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a_m + offs_k[None, :],
            mask=row_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_base + offs_n[None, :] * stride_w_n + offs_k[:, None],
            mask=k_valid[:, None] & n_valid[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_valid, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        scale = tl.load(weights_ptr + slots, mask=row_valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_c_m + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots [num_padded], tile_expert [num_padded // block_m]): slots in expert order,
    each expert's run padded with the sentinel num_slots to a multiple of block_m."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    order = flat.argsort(stable=True)  # [num_slots]
    counts = torch.bincount(flat, minlength=num_experts)  # [num_experts]
    padded = (counts + block_m - 1) // block_m * block_m  # [num_experts]
    run_start = torch.cumsum(padded, 0) - padded
    count_start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - count_start[sorted_experts]
    sorted_slots = torch.full(
        (int(padded.sum()),), num_slots, dtype=torch.int64, device=flat.device
    )
    sorted_slots[run_start[sorted_experts] + rank] = order
    tile_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m
    )
    return sorted_slots, tile_expert


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_slots: torch.Tensor,
    tile_expert: torch.Tensor,
    num_slots: int,
    a_row_div: int,
    weights: torch.Tensor | None,
    bias: torch.Tensor | None,
    block_m: int,
) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    c = torch.empty(num_slots, n, dtype=a.dtype, device=a.device)  # [num_slots, N]
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        bias if bias is not None else w,
        c,
        sorted_slots,
        tile_expert,
        weights if weights is not None else c,
        num_slots,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        bias.stride(0) if bias is not None else 0,
        c.stride(0),
        A_ROW_DIV=a_row_div,
        HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE_DOT=a.dtype == torch.float32,
    )
    return c


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor] | GatedActivation,
    block_m: int = 16,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as lmengine.kernels.moe.fused_moe_ref."""
    named = {"x": x, "w_gate_up": w_gate_up, "w_down": w_down}
    named.update((k, v) for k, v in (("b_gate_up", b_gate_up), ("b_down", b_down)) if v is not None)
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise ValueError(f"fused_moe_triton: {name} must have a contiguous last dimension")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"fused_moe_triton: {name} must match x in dtype and device")
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    sorted_slots, tile_expert = align_by_expert(topk_ids, w_gate_up.shape[0], block_m)
    gate_up = _grouped_gemm(
        x, w_gate_up, sorted_slots, tile_expert, num_slots, top_k, None, b_gate_up, block_m
    )
    gate, up = gate_up.chunk(2, dim=-1)  # [num_slots, inter] each
    inner = gated(act_fn, gate, up).contiguous()  # [num_slots, inter]
    weights = topk_weights.flatten().to(x.dtype).contiguous()  # [num_slots]
    y = _grouped_gemm(
        inner, w_down, sorted_slots, tile_expert, num_slots, 1, weights, b_down, block_m
    )
    return y.view(num_tokens, top_k, -1).sum(1)  # [num_tokens, hidden]
