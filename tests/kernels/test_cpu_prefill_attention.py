"""The compiled prefill kernel (kernels/csrc/prefill_attention_ops.cpp) against the dense
causal reference, and the CPU path's choice of it."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_features
from lmengine.kernels.paged_attention import paged_attention_cpu
from tests.kernels.helpers import dense_causal_attention, make_paged_batch

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ext(ext):
    """The kernels, where the prefill kernel is offered."""
    if not ext.prefill_attention_available():
        pytest.skip("not offered here: a torch without oneDNN, or a build without AVX-512")
    return ext


# (q_lens, kv_lens): whole prompts, prompts longer than a task's 16-64 rows and a tile's 128
# keys, chunks with cached history, and a decode row among them
CASES = [
    ([5], [5]),
    ([128, 256], [128, 256]),  # key counts that fill their last tile exactly
    ([16], [128]),
    ([100, 37], [100, 37]),
    ([300, 2], [300, 2]),
    ([30, 64, 1], [200, 64, 17]),
    ([129, 65], [400, 65]),
    ([100] * 12, [100] * 12),  # a burst of short prompts: the bfloat16 kernel's task batches
]


def poison_unowned_slots(k_cache, v_cache, tables, kv_lens):
    """NaN in every cache slot no sequence owns: a kernel that read past a sequence's keys
    would carry it into the output."""
    free = torch.ones(k_cache.shape[:2], dtype=torch.bool)
    block_size = k_cache.shape[1]
    for table, length in zip(tables.tolist(), kv_lens):
        for pos in range(length):
            free[table[pos // block_size], pos % block_size] = False
    k_cache[free] = float("nan")
    v_cache[free] = float("nan")


@pytest.mark.parametrize("q_lens,kv_lens", CASES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize(
    "heads,head_dim", [((9, 3), 64), ((4, 4), 16), ((8, 1), 32), ((4, 2), 128), ((6, 2), 40)]
)
def test_prefill_kernel_matches_dense_attention(
    ext, q_lens, kv_lens, block_size, heads, head_dim, threads
):
    num_heads, num_kv_heads = heads
    q, kc, vc, meta, dk, dv = make_paged_batch(
        q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, seed=sum(q_lens)
    )
    scale = head_dim**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale).float()
    poison_unowned_slots(kc, vc, meta.block_tables, kv_lens)
    # q as the engine passes it: a view of the fused QKV output (rows strided)
    wide = torch.randn(q.shape[0], (num_heads + 2 * num_kv_heads) * head_dim)
    wide[:, : num_heads * head_dim] = q.reshape(q.shape[0], -1)
    q_view = wide[:, : num_heads * head_dim].view(q.shape)
    out = torch.full_like(q, float("nan"))
    tables = meta.block_tables.contiguous()
    ext.paged_prefill_attention(
        q_view, kc, vc, tables, meta.q_start_loc, meta.q_lens, meta.kv_lens, scale, out
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_cpu_path_takes_it_for_prompt_chunks(ext, monkeypatch):
    q_lens, kv_lens = [1, 40, 1, 7], [30, 90, 2, 7]
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, 6, 2, 32, 4, seed=3)
    scale = 32**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale).float()
    calls = []
    real = ext.paged_prefill_attention

    def spy(*args):
        calls.append(args[4].numel())  # sequences in the call
        return real(*args)

    monkeypatch.setattr(ext, "paged_prefill_attention", spy)
    torch.testing.assert_close(paged_attention_cpu(q, kc, vc, meta, scale), expected)
    # the two prompt chunks (one fresh, one with history) in their groups
    assert calls == [1, 1]
    calls.clear()
    paged_attention_cpu(q, kc, vc, meta, scale, sliding_window=8)  # the SDPA path
    paged_attention_cpu(q, kc, vc, meta, scale, softcap=5.0)
    assert calls == []


def test_prefill_kernel_rejects_bad_input(ext):
    q, kc, vc, meta, *_ = make_paged_batch([6], [6], 4, 2, 16, 4)
    args = (meta.block_tables.contiguous(), meta.q_start_loc, meta.q_lens, meta.kv_lens)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="q must be float32"):
        ext.paged_prefill_attention(q.double(), kc, vc, *args, 1.0, out)
    with pytest.raises(RuntimeError, match="does not fit"):
        bad = (args[0], args[1], args[2], args[3] + 100)
        ext.paged_prefill_attention(q, kc, vc, *bad, 1.0, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ext.paged_prefill_attention(q, kc, vc, *args, 1.0, out[:3])
    with pytest.raises(RuntimeError, match="heads % kv_heads"):
        ext.paged_prefill_attention(q[:, :3], kc, vc, *args, 1.0, out[:, :3].contiguous())


@pytest.fixture(scope="module")
def bf16_ext(ext):
    if not cpu_features.has_bf16_units():
        pytest.skip("the bfloat16 prefill kernel runs on AMX / AVX512-BF16, which this CPU lacks")
    return ext


@pytest.mark.parametrize("q_lens,kv_lens", CASES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    "heads,head_dim", [((9, 3), 64), ((8, 1), 32), ((4, 2), 128), ((6, 2), 40)]
)
def test_bf16_prefill_kernel_matches_dense_attention(
    bf16_ext, q_lens, kv_lens, block_size, heads, head_dim, threads
):
    """bfloat16 GEMMs on the matrix units, float32 softmax: against float64 attention of the
    same bfloat16 inputs, within bfloat16's rounding of the probabilities and the output."""
    num_heads, num_kv_heads = heads
    q, kc, vc, meta, dk, dv = make_paged_batch(
        q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, BF16, seed=sum(q_lens)
    )
    scale = head_dim**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale)  # float64
    poison_unowned_slots(kc, vc, meta.block_tables, kv_lens)
    wide = torch.randn(q.shape[0], (num_heads + 2 * num_kv_heads) * head_dim).to(BF16)
    wide[:, : num_heads * head_dim] = q.reshape(q.shape[0], -1)
    q_view = wide[:, : num_heads * head_dim].view(q.shape)
    out = torch.full_like(q, float("nan"))
    tables = meta.block_tables.contiguous()
    bf16_ext.paged_prefill_attention_bf16(
        q_view, kc, vc, tables, meta.q_start_loc, meta.q_lens, meta.kv_lens, scale, out
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2e-2)
    # the float32 kernel on the same values, as a second opinion
    out32 = torch.empty(q.shape)
    bf16_ext.paged_prefill_attention(
        q.float(),
        kc.float().nan_to_num(),
        vc.float().nan_to_num(),
        tables,
        meta.q_start_loc,
        meta.q_lens,
        meta.kv_lens,
        scale,
        out32,
    )
    torch.testing.assert_close(out.float(), out32, rtol=2**-6, atol=2e-2)


def test_bf16_cpu_path_takes_it_only_with_the_units(bf16_ext, monkeypatch):
    q_lens, kv_lens = [1, 40, 1, 7], [30, 90, 2, 7]
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, 6, 2, 32, 4, BF16, seed=3)
    scale = 32**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale)
    calls = []
    real = bf16_ext.paged_prefill_attention_bf16

    def spy(*args):
        calls.append(args[4].numel())
        return real(*args)

    monkeypatch.setattr(bf16_ext, "paged_prefill_attention_bf16", spy)
    out = paged_attention_cpu(q, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2e-2)
    assert calls == [1, 1]
    calls.clear()
    # a CPU without bfloat16 units (the probe mocked): the gather + SDPA path, same result
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f"}))
    out = paged_attention_cpu(q, kc, vc, meta, scale)
    torch.testing.assert_close(out.double(), expected, rtol=2**-6, atol=2e-2)
    assert calls == []


def test_bf16_prefill_kernel_rejects_bad_input(bf16_ext):
    q, kc, vc, meta, *_ = make_paged_batch([6], [6], 4, 2, 16, 4, BF16)
    args = (meta.block_tables.contiguous(), meta.q_start_loc, meta.q_lens, meta.kv_lens)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="q must be bfloat16"):
        bf16_ext.paged_prefill_attention_bf16(q.float(), kc, vc, *args, 1.0, out)
    with pytest.raises(RuntimeError, match="k_cache must be a bfloat16"):
        bf16_ext.paged_prefill_attention_bf16(q, kc.float(), vc.float(), *args, 1.0, out)
    with pytest.raises(RuntimeError, match="out must be"):
        bf16_ext.paged_prefill_attention_bf16(q, kc, vc, *args, 1.0, out.float())
