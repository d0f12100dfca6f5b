"""The Triton paged-attention and KV-fill kernels against their PyTorch references at real
sizes: SmolLM2's and Llama-7B-like head counts (MHA and GQA, head_dim 64 and 128), contexts up
to 4,096 tokens, dozens of sequences, block sizes 16 and 32, prefill and decode in one batch,
the int8 cache, sliding windows and soft caps.

Inputs come from tests/kernels/helpers.py: each sequence's keys are scattered over a randomly
permuted block pool with garbage in every slot nobody owns, so a wrong block-table lookup, a
missing mask or a tile that stops early shows up as a mismatch. References run on the CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from lmengine.kernels.fill_kv_cache import fill_kv_cache_ref
from lmengine.kernels.paged_attention import paged_attention_ref
from tests.gpu.common import by_mode
from tests.kernels.helpers import make_paged_batch
from tests.kernels.test_fill_kv_cache import _inputs as fill_inputs
from tests.kernels.test_kv_int8 import _quantized_batch
from tests.kernels.test_triton_paged_attention import TOL, _meta_to

pytestmark = pytest.mark.gpu

# name: (num_heads, num_kv_heads, head_dim)
HEADS = by_mode(
    gpu={"smollm2": (9, 3, 64), "llama7b": (32, 32, 128), "llama3_8b_gqa": (32, 8, 128)},
    cpu={"smollm2": (9, 3, 64), "gqa_128": (8, 2, 128)},
)


def _decode_lens(num_seqs: int, longest: int, seed: int = 0) -> list[int]:
    """Context lengths of a decode batch: 1, one block, the longest, the rest at random."""
    rng = random.Random(seed)
    return [1, 16, longest] + [rng.randint(2, longest // 2) for _ in range(num_seqs - 3)]


# name: (q_lens, kv_lens)
BATCHES = by_mode(
    gpu={
        "decode_many": ([1] * 32, _decode_lens(32, 4096)),
        "prefill_long": ([2048, 777, 1], [2048, 777, 1]),
        # chunks of prompts with history next to decodes and a fresh prompt
        "chunked_mixed": ([512, 1, 1, 100, 33], [3000, 4096, 17, 100, 1500]),
    },
    cpu={
        "decode_many": ([1] * 6, _decode_lens(6, 200)),
        "prefill_long": ([150, 37, 1], [150, 37, 1]),
        "chunked_mixed": ([40, 1, 1, 20], [300, 200, 17, 20]),
    },
)
# the interpreter cannot multiply bfloat16 (tests/kernels/test_triton_paged_attention.py)
HALF_DTYPES = by_mode(gpu=[torch.float16, torch.bfloat16], cpu=[torch.float16])


def _attend(device, q, k_cache, v_cache, meta, scale, window=None, softcap=None, scales=()):
    from lmengine.kernels.triton.paged_attention import paged_attention_triton

    dev_meta = _meta_to(meta, device)
    dev = [t.to(device) for t in (q, k_cache, v_cache, *scales)]
    out = paged_attention_triton(*dev[:3], dev_meta, scale, window, softcap, *dev[3:])
    assert out.shape == q.shape and out.dtype == q.dtype
    return out.cpu()


def _check(device, batch, heads, block_size, dtype, seed, window=None, softcap=None):
    q_lens, kv_lens = BATCHES[batch]
    num_heads, num_kv_heads, head_dim = heads
    q, kc, vc, meta, _, _ = make_paged_batch(
        q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, seed=seed
    )
    scale = head_dim**-0.5
    expected = paged_attention_ref(q, kc, vc, meta, scale, window, softcap)
    out = _attend(device, q, kc, vc, meta, scale, window, softcap)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_float32(device, batch, heads, block_size):
    _check(device, batch, HEADS[heads], block_size, torch.float32, seed=block_size)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_paged_attention_half(device, batch, heads, dtype):
    _check(device, batch, HEADS[heads], 16, dtype, seed=3)


# Gemma 2's head_dim 256 (keys in tiles of 32) with its soft cap, and a Mistral-like window
# shorter than the contexts, so the key loop starts inside the sequence
WINDOWED = by_mode(
    gpu={"gemma2": ((8, 4, 256), 1024, 50.0), "mistral": ((32, 8, 128), 1000, None)},
    cpu={"gemma2": ((4, 2, 256), 64, 50.0), "mistral": ((8, 2, 128), 50, None)},
)


@pytest.mark.parametrize("batch", ["decode_many", "chunked_mixed"])
@pytest.mark.parametrize("model", list(WINDOWED))
@pytest.mark.parametrize("dtype", by_mode(gpu=[torch.float32, torch.bfloat16], cpu=[torch.float32]))
def test_paged_attention_window_and_softcap(device, batch, model, dtype):
    heads, window, softcap = WINDOWED[model]
    assert window < max(BATCHES[batch][1])  # the window must cut some context
    _check(device, batch, heads, 32, dtype, seed=7, window=window, softcap=softcap)


@pytest.mark.parametrize("batch", ["decode_many", "chunked_mixed"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_paged_attention_int8_cache(device, batch, heads, block_size, dtype):
    """Attention over the dequantized int8 cache, as paged_attention_ref computes it."""
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    q_lens, kv_lens = BATCHES[batch]
    q, kq, vq, ks, vs, meta, _, _ = _quantized_batch(
        q_lens, kv_lens, (num_heads, num_kv_heads), head_dim, block_size, seed=11
    )
    q, scale = q.to(dtype), head_dim**-0.5
    expected = paged_attention_ref(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
    out = _attend(device, q, kq, vq, meta, scale, scales=(ks, vs))
    torch.testing.assert_close(out, expected, **TOL[dtype])


# (num_tokens, num_kv_heads, head_dim): a decode token, a ragged batch, a long prefill batch
FILLS = by_mode(
    gpu=[(1, 8, 128), (777, 3, 64), (8192, 8, 128), (4096, 32, 128)],
    cpu=[(1, 8, 128), (45, 3, 64), (60, 2, 128)],
)


def _fill_case(num_tokens, num_kv_heads, head_dim, block_size, dtype, seed):
    """fill_inputs over a pool with 20 % spare slots, and one token in ten (from the 6th) a
    padding slot."""
    num_blocks = -(-num_tokens * 6 // 5 // block_size) + 1
    k, v, kc, vc, slots = fill_inputs(
        num_tokens, num_kv_heads, head_dim, block_size, dtype, seed, num_blocks=num_blocks
    )
    slots[5::10] = -1  # writes nothing
    return k, v, kc, vc, slots


@pytest.mark.parametrize("shape", FILLS, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fill_kv_cache(device, shape, block_size, dtype):
    from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

    k, v, kc, vc, slots = _fill_case(*shape, block_size, dtype, seed=block_size)
    k_ref, v_ref = kc.clone(), vc.clone()
    keep = slots >= 0
    fill_kv_cache_ref(k[keep], v[keep], k_ref, v_ref, slots[keep])
    kc_dev, vc_dev = kc.to(device), vc.to(device)
    fill_kv_cache_triton(k.to(device), v.to(device), kc_dev, vc_dev, slots.to(device))
    assert torch.equal(kc_dev.cpu(), k_ref) and torch.equal(vc_dev.cpu(), v_ref)


@pytest.mark.parametrize("shape", FILLS, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fill_kv_cache_int8(device, shape, block_size, dtype):
    """Quantized on the way in: int8 values within one step of the reference (the kernel
    rounds half away from zero, torch.round half to even) and the same float32 scales."""
    from lmengine.kernels.triton.fill_kv_cache import fill_kv_cache_triton

    k, v, kc, _, slots = _fill_case(*shape, block_size, dtype, seed=block_size + 1)
    pages = [torch.randint(-127, 128, kc.shape, dtype=torch.int8) for _ in range(2)]
    scales = [torch.rand(kc.shape[:3]) for _ in range(2)]  # garbage outside written slots
    ref = [t.clone() for t in pages + scales]
    keep = slots >= 0
    fill_kv_cache_ref(k[keep], v[keep], *ref[:2], slots[keep], *ref[2:])
    dev = [t.to(device) for t in pages + scales]
    fill_kv_cache_triton(k.to(device), v.to(device), dev[0], dev[1], slots.to(device), *dev[2:])
    for got, want in zip(dev[:2], ref[:2]):
        diff = (got.cpu().int() - want.int()).abs()
        assert int(diff.max()) <= 1, "an int8 value more than one rounding step off"
        assert float((diff == 0).float().mean()) > 0.99
    for got, want in zip(dev[2:], ref[2:]):
        torch.testing.assert_close(got.cpu(), want)
