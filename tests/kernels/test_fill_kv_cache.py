"""KV-cache fill: CPU dispatch vs reference vs an independent per-slot formula, and the Triton
launcher. A pure copy, so every comparison is exact."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import fill_kv_cache
from lmengine.kernels.fill_kv_cache import fill_kv_cache_ref, rotary_fill_kv_cpu
from lmengine.kernels.rotary import apply_rotary_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS_DIM = [(4, 16), (2, 64), (1, 24)]  # (num_kv_heads, head_dim)
# number of tokens written: one, not a multiple of any block size, and every slot of the pool
NUM_TOKENS = [1, 7, "all"]


def _inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype, seed, num_blocks=5):
    """Random k, v, a random garbage cache and unique random slots (as a paged allocator gives)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_blocks * block_size
    if num_tokens == "all":
        num_tokens = num_slots
    num_tokens = min(num_tokens, num_slots)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    return k, v, k_cache, v_cache, slots


def _expected(k, v, k_cache, v_cache, slots):
    """Independent formula: token t lands in block slots[t] // bs at offset slots[t] % bs;
    every other slot keeps its old contents."""
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t in range(k.shape[0]):
        block, offset = divmod(int(slots[t]), block_size)
        k_exp[block, offset] = k[t]
        v_exp[block, offset] = v[t]
    return k_exp, v_exp


# --- CPU dispatch path -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads_dim", HEADS_DIM)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_fill_kv_cache_cpu_matches_reference(dtype, heads_dim, block_size, num_tokens):
    k, v, kc, vc, slots = _inputs(num_tokens, *heads_dim, block_size, dtype, seed=block_size)
    k_exp, v_exp = _expected(k, v, kc, vc, slots)
    k_ref, v_ref = kc.clone(), vc.clone()
    fill_kv_cache_ref(k, v, k_ref, v_ref, slots)
    fill_kv_cache(k, v, kc, vc, slots)
    for got, ref, exp in ((kc, k_ref, k_exp), (vc, v_ref, v_exp)):
        assert torch.equal(got, exp)
        assert torch.equal(ref, exp)


def test_fill_kv_cache_cpu_accepts_int32_slots():
    k, v, kc, vc, slots = _inputs(5, 2, 16, 4, torch.float32, seed=0)
    k_exp, v_exp = _expected(k, v, kc, vc, slots)
    fill_kv_cache(k, v, kc, vc, slots.to(torch.int32))
    assert torch.equal(kc, k_exp) and torch.equal(vc, v_exp)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 24)])
@pytest.mark.parametrize("num_tokens", [1, 7, "all"])
def test_fused_rotary_fill_is_bit_identical_to_rotary_then_fill(
    heads, kv_heads, head_dim, num_tokens
):
    # q, k, v as column slices of one fused qkv output (rows strided), as the model gives them
    _, _, kc, vc, slots = _inputs(num_tokens, kv_heads, head_dim, 4, torch.float32, seed=3)
    n = slots.numel()
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    angles = torch.rand(n, head_dim // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_ref, k_ref = apply_rotary_ref(
        q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim), cos, sin
    )
    k_exp, v_exp = _expected(k_ref, v.reshape(n, kv_heads, head_dim), kc, vc, slots)
    q_out = rotary_fill_kv_cpu(q, k, v, cos, sin, kc, vc, slots.to(torch.int32))
    assert q_out is not None, "the compiled kernels did not build"
    assert torch.equal(q_out, q_ref)
    assert torch.equal(kc, k_exp) and torch.equal(vc, v_exp)


def test_fused_rotary_fill_declines_what_it_does_not_cover():
    _, _, kc, vc, slots = _inputs(3, 2, 16, 4, torch.float32, seed=0)
    q, k, v = torch.randn(3, 64), torch.randn(3, 32), torch.randn(3, 32)
    cos = sin = torch.ones(3, 16)
    assert rotary_fill_kv_cpu(q, k, v, cos[:, :8], sin[:, :8], kc, vc, slots) is None  # partial
    half = (kc.half(), vc.half())
    assert rotary_fill_kv_cpu(q, k, v, cos, sin, *half, slots) is None  # not float32
    with pytest.raises(RuntimeError, match="out of range"):
        rotary_fill_kv_cpu(q, k, v, cos, sin, kc, vc, torch.tensor([0, 1, 10**6]))


def test_fill_kv_cache_cpu_rejects_mismatched_cache():
    k, v, kc, vc, slots = _inputs(3, 2, 16, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        fill_kv_cache(k[:, :1], v[:, :1], kc, vc, slots)


# --- Triton launcher ---------------------------------------------------------------------------


def _check_triton_fill(device, dtype, heads_dim, block_size, num_tokens, slot_dtype):
    from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

    k, v, kc, vc, slots = _inputs(num_tokens, *heads_dim, block_size, dtype, seed=block_size + 1)
    k_ref, v_ref = kc.clone(), vc.clone()
    fill_kv_cache_ref(k, v, k_ref, v_ref, slots)
    kc_dev, vc_dev = kc.to(device), vc.to(device)
    fill_kv_cache_triton(k.to(device), v.to(device), kc_dev, vc_dev, slots.to(device, slot_dtype))
    assert torch.equal(kc_dev.cpu(), k_ref)
    assert torch.equal(vc_dev.cpu(), v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads_dim", HEADS_DIM)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_fill_kv_cache_triton_matches_reference(
    triton_device, dtype, heads_dim, block_size, num_tokens
):
    _check_triton_fill(triton_device, dtype, heads_dim, block_size, num_tokens, torch.int64)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_fill_kv_cache_triton_int32_slots(triton_device, block_size):
    _check_triton_fill(triton_device, torch.float16, (2, 64), block_size, 7, torch.int32)


def test_fill_kv_cache_triton_strided_views_and_padding_slots(triton_device):
    """Caches as views of a [2, layers, ...] pool, k/v split from a fused kv tensor, and
    negative (padding) slots that must write nothing."""
    from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 3
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(2, 3, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    slots = torch.tensor([3, -1, 0, 11, -1, 6])
    expected = pool.clone()
    valid = slots >= 0
    fill_kv_cache_ref(
        kv[valid, :num_kv_heads],
        kv[valid, num_kv_heads:],
        expected[0, 1],
        expected[1, 1],
        slots[valid],
    )
    pool_dev, kv_dev = pool.to(triton_device), kv.to(triton_device)
    k, v = kv_dev[:, :num_kv_heads], kv_dev[:, num_kv_heads:]  # token stride 2 * heads * dim
    fill_kv_cache_triton(k, v, pool_dev[0, 1], pool_dev[1, 1], slots.to(triton_device))
    assert torch.equal(pool_dev.cpu(), expected)


def test_fill_kv_cache_triton_rejects_bad_inputs(triton_device):
    from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

    k, v, kc, vc, slots = (t.to(triton_device) for t in _inputs(3, 2, 16, 4, torch.float32, 0))
    with pytest.raises(ValueError, match="does not fit"):
        fill_kv_cache_triton(k[:, :1], v[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="k and v must both be"):
        fill_kv_cache_triton(k, v[:2], kc, vc, slots)
    with pytest.raises(ValueError, match="k_cache and v_cache must both be"):
        fill_kv_cache_triton(k, v, kc, vc[:2], slots)
    with pytest.raises(ValueError, match="slot_mapping must be \\[3\\]"):
        fill_kv_cache_triton(k, v, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        fill_kv_cache_triton(k, v, kc, vc, slots.float())
    with pytest.raises(ValueError, match="differs from k dtype"):
        fill_kv_cache_triton(k, v, kc.half(), vc.half(), slots)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        fill_kv_cache_triton(k.double(), v.double(), kc.double(), vc.double(), slots)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        fill_kv_cache_triton(k, v, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, slots)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        fill_kv_cache_triton(k, v, kc, vc, torch.stack((slots, slots), 1)[:, 0])
