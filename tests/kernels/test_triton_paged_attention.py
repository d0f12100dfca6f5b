"""Triton varlen paged attention vs the dense float64 reference and paged_attention_ref.

Inputs come from make_paged_batch: each sequence's keys are scattered over a randomly permuted
block pool with garbage in every slot nobody owns, so a wrong block-table lookup or a missing
mask shows up as a numerical mismatch.
"""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels.paged_attention import paged_attention_ref
from tests.kernels.helpers import dense_causal_attention, make_paged_batch

CASES = {
    # name: (q_lens, kv_lens)
    "single_token": ([1], [1]),
    "decode_only": ([1, 1, 1], [5, 17, 32]),
    "prefill_only": ([7], [7]),
    "mixed": ([5, 1, 16, 1], [5, 9, 40, 1]),
    "chunked_prefill": ([3, 12], [20, 12]),
    # several query blocks per sequence and several key tiles, next to a long decode
    "max": ([70, 1], [130, 77]),
}
HEADS = [(4, 4), (8, 2), (6, 1)]  # (num_heads, num_kv_heads): MHA, GQA 4, GQA 6 (non power of 2)
# float32 uses IEEE dots: observed error vs the float64 reference is ~1e-6. float16 rounds the
# softmax probabilities to float16 before the PV dot (flash-attention style), and the output to
# float16: observed ~2e-3 (two ulps at 1.0) against paged_attention_ref.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
}


def _meta_to(meta, device):
    """The launcher reads the metadata tensors on the device of q."""
    for name in ("block_tables", "q_start_loc", "q_lens", "kv_lens"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


def _run(device, case, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q_lens, kv_lens = CASES[case]
    q, kc, vc, meta, dk, dv = make_paged_batch(
        q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, seed=seed
    )
    scale = head_dim**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale)
    ref = paged_attention_ref(q, kc, vc, meta, scale)
    meta = _meta_to(meta, device)
    out = paged_attention_triton(q.to(device), kc.to(device), vc.to(device), meta, scale)
    assert out.shape == q.shape and out.dtype == dtype
    out = out.cpu()
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_triton_float32_head_dim_16(triton_device, case, block_size, heads, seed):
    _run(triton_device, case, *heads, 16, block_size, torch.float32, seed)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", HEADS)
def test_paged_attention_triton_float32_head_dim_64(triton_device, case, heads):
    _run(triton_device, case, *heads, 64, 16, torch.float32, seed=2)


@pytest.mark.parametrize("case", ["decode_only", "mixed", "max"])
@pytest.mark.parametrize("head_dim", [24, 40])
def test_paged_attention_triton_head_dim_not_power_of_two(triton_device, case, head_dim):
    _run(triton_device, case, 8, 2, head_dim, 4, torch.float32, seed=3)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_paged_attention_triton_float16(triton_device, case, head_dim):
    _run(triton_device, case, 8, 2, head_dim, 4, torch.float16, seed=4)


@pytest.mark.parametrize("case", ["mixed", "max"])
def test_paged_attention_triton_bfloat16(triton_device, triton_interpreted, case):
    if triton_interpreted:
        pytest.skip(
            "the Triton 3.9 interpreter's tl.dot multiplies bfloat16 operands as their raw "
            "uint16 bit patterns; bfloat16 attention can only be checked on a GPU"
        )
    _run(triton_device, case, 8, 2, 64, 16, torch.bfloat16, seed=5)


def test_paged_attention_triton_strided_q(triton_device):
    """q as a view into a fused qkv projection (token stride > heads * head_dim)."""
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q_lens, kv_lens = CASES["mixed"]
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, 8, 2, 16, 4, seed=6)
    qkv = torch.cat((q.flatten(1), torch.randn(q.shape[0], 2 * 2 * 16)), dim=1)
    q_view = qkv.to(triton_device)[:, : 8 * 16].view(-1, 8, 16)
    assert not q_view.is_contiguous()
    meta = _meta_to(meta, triton_device)
    out = paged_attention_triton(q_view, kc.to(triton_device), vc.to(triton_device), meta, 0.25)
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, 0.25)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])


def test_paged_attention_triton_rejects_bad_inputs(triton_device):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    q, kc, vc, meta, _, _ = make_paged_batch([2, 1], [2, 5], 4, 2, 16, 4)
    q, kc, vc = q.to(triton_device), kc.to(triton_device), vc.to(triton_device)
    meta = _meta_to(meta, triton_device)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_triton(q[:, :3], kc, vc, meta, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_triton(q[..., :8], kc, vc, meta, 1.0)
    with pytest.raises(ValueError, match="must both be"):
        paged_attention_triton(q, kc, vc[:, :2], meta, 1.0)
    with pytest.raises(ValueError, match="block size"):
        paged_attention_triton(q, kc[:, :2], vc[:, :2], meta, 1.0)
    with pytest.raises(ValueError, match="differs from q dtype"):
        paged_attention_triton(q, kc.half(), vc.half(), meta, 1.0)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        paged_attention_triton(q.double(), kc.double(), vc.double(), meta, 1.0)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        paged_attention_triton(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, meta, 1.0)
    with pytest.raises(ValueError, match=r"\[num_tokens, num_heads, head_dim\]"):
        paged_attention_triton(q.flatten(1), kc, vc, meta, 1.0)
    meta.kv_lens = meta.kv_lens.long()
    with pytest.raises(ValueError, match="meta.kv_lens must be int32"):
        paged_attention_triton(q, kc, vc, meta, 1.0)
