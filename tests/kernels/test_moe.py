"""Mixture-of-experts kernels: the CPU path grouped by expert and the Triton grouped GEMM
(under TRITON_INTERPRET=1 on CPU) against the dense per-slot reference, and the reference
against transformers' own Mixtral experts module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmengine.kernels.moe import fused_moe, fused_moe_ref

SHAPES = {
    # name: (num_tokens, num_experts, top_k, hidden, inter)
    "decode": (1, 4, 2, 32, 48),
    "small": (7, 4, 2, 32, 48),
    "many_tokens": (40, 8, 2, 24, 40),  # several row tiles per expert, dims not powers of 2
    "top1": (9, 3, 1, 16, 16),
    "unused_experts": (3, 16, 2, 32, 32),  # most experts get no token
}


def _inputs(num_tokens, num_experts, top_k, hidden, inter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, -1)
    return x, w_gate_up, w_down, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("name", list(SHAPES))
def test_cpu_path_matches_reference(name):
    args = _inputs(*SHAPES[name])
    torch.testing.assert_close(fused_moe(*args, F.silu), fused_moe_ref(*args, F.silu))


@pytest.mark.parametrize("name", list(SHAPES))
def test_cpu_path_on_packed_weights_matches_reference(name):
    from lmengine.kernels.moe import pack_experts

    x, wgu, wd, weights, ids = _inputs(*SHAPES[name], seed=3)
    packed = (pack_experts(wgu), pack_experts(wd))
    if packed[0] is None:
        pytest.skip("oneDNN weight packing is not available in this torch build")
    got = fused_moe(x, wgu, wd, weights, ids, F.silu, packed)
    torch.testing.assert_close(got, fused_moe_ref(x, wgu, wd, weights, ids, F.silu))


@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_reference(triton_device, name):
    from lmengine.kernels.triton.moe import fused_moe_triton

    x, wgu, wd, weights, ids = _inputs(*SHAPES[name], seed=1)
    expected = fused_moe_ref(x, wgu, wd, weights, ids, F.silu)
    dev = triton_device
    got = fused_moe_triton(x.to(dev), wgu.to(dev), wd.to(dev), weights.to(dev), ids.to(dev), F.silu)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_align_by_expert_pads_each_run():
    from lmengine.kernels.triton.moe import align_by_expert

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # slots 0..5
    slots, tile_expert = align_by_expert(ids, 4, 4)
    sentinel = ids.numel()
    assert tile_expert.tolist() == [0, 1, 2]  # expert 3 has no token, no tile
    assert slots.tolist() == [1, 4, sentinel, sentinel, 3] + [sentinel] * 3 + [0, 2, 5, sentinel]


def test_reference_matches_transformers_mixtral_experts():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4)
    experts = MixtralExperts(cfg)
    x, wgu, wd, weights, ids = _inputs(11, 4, 2, 32, 48, seed=2)
    with torch.no_grad():
        experts.gate_up_proj.copy_(wgu)
        experts.down_proj.copy_(wd)
        expected = experts(x, ids, weights)
    torch.testing.assert_close(fused_moe(x, wgu, wd, weights, ids, experts.act_fn), expected)


def test_rejects_bad_shapes():
    x, wgu, wd, weights, ids = _inputs(*SHAPES["small"])
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe(x[:, :8], wgu, wd, weights, ids, F.silu)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, wgu, wd, weights[:, :1], ids, F.silu)
