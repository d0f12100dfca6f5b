from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_ext
from lmengine.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.helpers import dense_causal_attention, make_paged_batch

CASES = [
    # (q_lens, kv_lens): decode only, prefill only, mixed, chunked prefill over history
    ([1], [1]),
    ([1, 1, 1], [5, 17, 32]),
    ([7], [7]),
    ([5, 1, 16, 1], [5, 9, 40, 1]),
    ([3, 12], [20, 12]),
    ([9, 4, 1, 6], [9, 4, 30, 10]),  # fresh prompts (causal path) beside history and decode
]


@pytest.mark.parametrize("q_lens,kv_lens", CASES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_cpu_matches_references(q_lens, kv_lens, block_size, heads, seed):
    num_heads, num_kv_heads = heads
    head_dim = 16
    q, kc, vc, meta, dk, dv = make_paged_batch(
        q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, seed=seed
    )
    scale = head_dim**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale).float()
    ref = paged_attention_ref(q, kc, vc, meta, scale)
    fast = paged_attention(q, kc, vc, meta, scale)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_bfloat16():
    q, kc, vc, meta, dk, dv = make_paged_batch(
        [4, 1], [10, 33], 4, 2, 32, 8, dtype=torch.bfloat16, seed=3
    )
    expected = dense_causal_attention(q, dk, dv, [4, 1], [10, 33], 32**-0.5)
    fast = paged_attention(q, kc, vc, meta, 32**-0.5)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_rejects_bad_head_ratio():
    q, kc, vc, meta, _, _ = make_paged_batch([2], [2], 4, 4, 8, 4)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], kc, vc, meta, 1.0)


@pytest.mark.parametrize(
    "q_lens,kv_lens", [([1, 1, 1, 1, 1], [9, 40, 3, 17, 33]), ([5, 1, 16], [5, 9, 40])]
)
def test_groups_split_to_fit_the_cache_give_the_same_result(q_lens, kv_lens, monkeypatch):
    monkeypatch.setattr(cpu_ext, "load", lambda: None)  # the gather path: the one that splits
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, 4, 2, 16, 4, seed=7)
    # a KV token so large that every group is split into single sequences
    split = type(meta).build(
        [t.tolist() for t in meta.block_tables], q_lens, kv_lens, 4, "cpu", kv_token_bytes=1 << 30
    )
    assert len(split.groups) == len(q_lens) >= len(meta.groups)
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, 0.25)
    torch.testing.assert_close(paged_attention(q, kc, vc, split, 0.25), expected.float())
