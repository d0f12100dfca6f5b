"""Triton RMSNorm, optionally fused with the residual add that precedes it.

One program normalises one row of x: [num_rows, hidden] (last dim contiguous). The sum of
squares is accumulated in float32; the row is normalised in float32, cast to the input dtype and
then multiplied by the weight, exactly as `rms_norm_ref` (transformers' LlamaRMSNorm). The output
dtype is `torch.promote_types(x.dtype, weight.dtype)`, as in the reference.

Rows of up to `MAX_BLOCK` elements stay in registers; longer rows take a second pass over memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK = 8192  # largest row, in elements, that one program keeps in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden]; read only if HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden], residual + x; written only if HAS_RESIDUAL
    stride_x_row,
    stride_residual_row,
    stride_out_row,
    stride_residual_out_row,
    hidden,
    eps,
    BLOCK_SIZE: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,  # the whole row fits in one BLOCK_SIZE tile
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * stride_x_row
    residual_row_ptr = residual_ptr + row * stride_residual_row
    out_row_ptr = out_ptr + row * stride_out_row
    residual_out_row_ptr = residual_out_ptr + row * stride_residual_out_row
    in_dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]

    if SINGLE_BLOCK:
        mask = offs < hidden
        x = tl.load(x_row_ptr + offs, mask=mask, other=0.0)  # [BLOCK_SIZE]
        if HAS_RESIDUAL:
            residual = tl.load(residual_row_ptr + offs, mask=mask, other=0.0)
            # round the sum to the input dtype, as `residual + x` does in PyTorch
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(in_dtype)
            tl.store(residual_out_row_ptr + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (xf * rstd).to(in_dtype).to(tl.float32) * weight
        tl.store(out_row_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # pass 1: sum of squares (and the summed residual, written out)
        sq_acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)  # [BLOCK_SIZE]
        for start in range(0, hidden, BLOCK_SIZE):
            cols = start + offs
            mask = cols < hidden
            x = tl.load(x_row_ptr + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(residual_row_ptr + cols, mask=mask, other=0.0)
                x = (x.to(tl.float32) + residual.to(tl.float32)).to(in_dtype)
                tl.store(residual_out_row_ptr + cols, x, mask=mask)
            xf = x.to(tl.float32)
            sq_acc += xf * xf
        rstd = tl.rsqrt(tl.sum(sq_acc, axis=0) / hidden + eps)
        # pass 2: normalise. NOTE: the sum is recomputed from the inputs rather than re-read
        # from residual_out, so no ordering between this program's stores and loads is assumed.
        for start in range(0, hidden, BLOCK_SIZE):
            cols = start + offs
            mask = cols < hidden
            x = tl.load(x_row_ptr + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                residual = tl.load(residual_row_ptr + cols, mask=mask, other=0.0)
                x = (x.to(tl.float32) + residual.to(tl.float32)).to(in_dtype)
            weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x.to(tl.float32) * rstd).to(in_dtype).to(tl.float32) * weight
            tl.store(out_row_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """View t: [..., hidden] as [num_rows, hidden] without copying."""
    if t.dim() < 1 or t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dimension")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as exc:
        raise ValueError(
            f"{op}: {name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed "
            "as [num_rows, hidden] without a copy"
        ) from exc


def _check(x: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    if x.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{op}: x and weight must be float16, bfloat16 or float32, got {x.dtype} and "
            f"{weight.dtype}"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(
            f"{op}: x must be [num_rows, hidden] with hidden > 0, got {tuple(x.shape)}"
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight must be [{x.shape[-1]}] to match x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous")
    if weight.device != x.device:
        raise ValueError(f"{op}: x is on {x.device} but weight is on {weight.device}")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    op: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = _as_rows(x, "x", op)
    res2 = _as_rows(residual, "residual", op) if residual is not None else x2
    num_rows, hidden = x2.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = (
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    )
    if num_rows == 0:
        return out, residual_out
    out2 = out.view(-1, hidden)
    res_out2 = residual_out.view(-1, hidden) if residual_out is not None else out2
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    _rms_norm_kernel[(num_rows,)](
        x2,
        res2,
        weight,
        out2,
        res_out2,
        x2.stride(0),
        res2.stride(0),
        out2.stride(0),
        res_out2.stride(0),
        hidden,
        float(eps),
        BLOCK_SIZE=block,
        SINGLE_BLOCK=block >= hidden,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 8),
    )
    return out, residual_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden]; weight: [hidden] -> [num_tokens, hidden] (a new tensor)."""
    _check(x, weight, "rms_norm_triton")
    out, _ = _launch(x, None, weight, eps, "rms_norm_triton")
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(residual + x), residual + x), both new [num_tokens, hidden] tensors."""
    op = "add_rms_norm_triton"
    _check(x, weight, op)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"{op}: residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    if residual.device != x.device:
        raise ValueError(f"{op}: x is on {x.device} but residual is on {residual.device}")
    out, summed = _launch(x, residual, weight, eps, op)
    assert summed is not None
    return out, summed
