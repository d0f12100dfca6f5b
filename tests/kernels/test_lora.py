"""Multi-LoRA kernel: CPU path and Triton launcher against the per-token reference, over ranks,
segment layouts (one token, many segments, interleaved adapters, tokens without adapter)."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels.lora import LoRAMeta, lora_add, lora_add_cpu, lora_add_ref, lora_add_tiles

# "compiled" is the C++ kernel whenever it builds (tests/kernels/test_w8a8.py checks it does)
CPU_PATHS = {"compiled": lora_add_cpu, "torch tiles": lora_add_tiles}

# token -> adapter layouts: -1 = no adapter
LAYOUTS = {
    "one token": [0],
    "one token no adapter": [-1],
    "all base": [-1, -1, -1],
    "one segment": [1] * 7,
    "many segments": [0, 0, 0, 1, 1, 2, 2, 2, 2, 2],
    "interleaved with base": [2, -1, 0, 2, 1, -1, 0, 0, 2, 1, -1],
    "long and short": [1] * 40 + [0] + [2] * 3,
}


def _pool(ranks, in_f, out_f, seed, dtype=torch.float32):
    """A shuffled pool holding adapters of `ranks`; the last page is the zero pad page."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(ranks) + 3  # some pages belong to nobody
    perm = torch.randperm(num_pages, generator=gen)
    max_rank = max(ranks)
    pad = num_pages  # index of the zero page
    table = torch.full((len(ranks), max_rank), pad, dtype=torch.long)
    used = 0
    for i, r in enumerate(ranks):
        table[i, :r] = perm[used : used + r]
        used += r
    lora_a = torch.randn(num_pages + 1, in_f, generator=gen)
    lora_b = torch.randn(num_pages + 1, out_f, generator=gen)
    scale = torch.rand(num_pages + 1, generator=gen) + 0.5
    lora_a[pad], lora_b[pad], scale[pad] = 0, 0, 0
    return lora_a.to(dtype), lora_b.to(dtype), scale, table


@pytest.mark.parametrize("path", list(CPU_PATHS))
@pytest.mark.parametrize("ranks", [(1, 1, 1), (4, 8, 16), (16, 2, 5)])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_cpu_matches_reference(ranks, layout, path):
    _cpu_case(CPU_PATHS[path], ranks, LAYOUTS[layout], 24, 40, seed=len(layout))


@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_cpu_at_model_shapes_split_across_threads(path):
    # SmolLM2's qkv shapes: the compiled kernel's tasks then hold 2 tokens, so its thread
    # chunks start and end inside segments
    layout = [3] * 9 + [0] * 20 + [-1] * 5 + [1, 2, 1, 2] + [2] * 30
    # deltas here reach ~420 (576-long dots of randn) and the tolerance scales with them:
    # 2e-6 of that stays under the flat 1e-3 this test had before (errors measured ~1.5e-4)
    _cpu_case(CPU_PATHS[path], (8, 16, 4, 12), layout, 576, 960, seed=5, tol=2e-6)


def test_compiled_kernel_reads_only_each_pages_columns():
    # pages of one part of a merged linear: B is zero outside the part's columns, and the
    # kernel, told the ranges, must not touch the rest (here made non-zero to show it)
    ranks, layout, in_f, out_f = (4, 8, 3), [0] * 5 + [1] * 9 + [2, -1, 0], 32, 200
    lora_a, lora_b, scale, table = _pool(ranks, in_f, out_f, seed=3)
    gen = torch.Generator().manual_seed(4)
    lo = torch.randint(0, out_f - 1, (lora_a.shape[0],), generator=gen)
    hi = lo + 1 + (torch.rand(lora_a.shape[0], generator=gen) * (out_f - lo)).long()
    cols = torch.stack([lo, hi.clamp(max=out_f)], 1)
    in_range = (torch.arange(out_f)[None, :] >= cols[:, :1]) & (
        torch.arange(out_f)[None, :] < cols[:, 1:]
    )
    token_adapter = torch.tensor(layout)
    x = torch.randn(len(layout), in_f, generator=gen)
    base = torch.randn(len(layout), out_f, generator=gen)
    masked_b = lora_b * in_range
    expected = lora_add_ref(base.clone(), x, lora_a, masked_b, scale, table, token_adapter)
    meta = LoRAMeta.build(token_adapter)
    out = lora_add_cpu(base.clone(), x, lora_a, lora_b, scale, table, meta, cols)
    _assert_close_to_scale(out, expected, base, tol=1e-5)


def _assert_close_to_scale(out, expected, base, tol):
    """float32 sums in another order differ by a few ulps of the largest LoRA delta (~20 in
    the small cases, so ~1e-5 absolute): scale the tolerance by it. A wrong page or scale
    moves an element by the size of a delta, far beyond this."""
    scale = max(1.0, (expected - base).abs().max().item())
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol * scale)


def _cpu_case(fn, ranks, layout, in_f, out_f, seed, tol=1e-5):
    token_adapter = torch.tensor(layout)
    lora_a, lora_b, scale, table = _pool(ranks, in_f, out_f, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(len(token_adapter), in_f, generator=gen)
    base = torch.randn(len(token_adapter), out_f, generator=gen)
    expected = lora_add_ref(base.clone(), x, lora_a, lora_b, scale, table, token_adapter)
    meta = LoRAMeta.build(token_adapter)
    out = fn(base.clone(), x, lora_a, lora_b, scale, table, meta)
    _assert_close_to_scale(out, expected, base, tol)
    # tokens without adapter are untouched, the others changed
    none = token_adapter < 0
    assert torch.equal(out[none], base[none])
    if (~none).any():
        assert not torch.allclose(out[~none], base[~none])


def test_meta_groups_segments_and_tiles():
    meta = LoRAMeta.build(torch.tensor([2, -1, 0, 2, 1, -1, 0, 0]))
    assert meta.seg_adapter.tolist() == [0, 1, 2]
    assert meta.seg_starts.tolist() == [0, 3, 4, 6]
    assert meta.sorted_tokens.tolist() == [2, 6, 7, 4, 0, 3]
    assert meta.max_seg_len == 3
    # every lora token sits in exactly one valid tile slot of its adapter
    valid = meta.tile_valid[..., 0].bool()
    assert sorted(meta.tile_tokens[valid].tolist()) == [0, 2, 3, 4, 6, 7]
    # one long segment and many short ones: tiles keep padding bounded
    long = LoRAMeta.build(torch.tensor([0] * 100 + list(range(1, 11))))
    assert long.tile_tokens.numel() <= 2 * 110 + long.tile_tokens.shape[1] * 11


# --- Triton launcher ---------------------------------------------------------------------------

TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-2, "atol": 2e-2},
    torch.bfloat16: {"rtol": 5e-2, "atol": 1e-1},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ranks", [(1, 3, 2), (4, 8, 16), (20, 2, 5)])
@pytest.mark.parametrize(
    "layout", ["one token", "all base", "many segments", "interleaved with base", "long and short"]
)
def test_triton_matches_reference(triton_device, dtype, ranks, layout):
    from lmengine.kernels.triton.lora import lora_add_triton

    in_f, out_f = 40, 72  # not multiples of the blocks
    token_adapter = torch.tensor(LAYOUTS[layout])
    lora_a, lora_b, scale, table = _pool(ranks, in_f, out_f, seed=3, dtype=dtype)
    x = torch.randn(len(token_adapter), in_f).to(dtype)
    base = torch.randn(len(token_adapter), out_f).to(dtype)
    expected = lora_add_ref(base.clone(), x, lora_a, lora_b, scale, table, token_adapter)
    dev = triton_device
    meta = LoRAMeta.build(token_adapter).to(dev)
    out = base.clone().to(dev)
    lora_add_triton(
        out, x.to(dev), lora_a.to(dev), lora_b.to(dev), scale.to(dev), table.to(dev), meta
    )
    torch.testing.assert_close(out.cpu().float(), expected.float(), **TOL[dtype])
    none = token_adapter < 0
    assert torch.equal(out.cpu()[none], base[none])


def test_triton_rejects_bad_inputs(triton_device):
    from lmengine.kernels.triton.lora import lora_add_triton

    lora_a, lora_b, scale, table = _pool((2,), 8, 8, seed=0)
    meta = LoRAMeta.build(torch.tensor([0, 0]))
    x, out = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        lora_add_triton(out.double(), x, lora_a, lora_b, scale, table, meta)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        lora_add_triton(out, torch.randn(8, 2).t(), lora_a, lora_b, scale, table, meta)
    with pytest.raises(ValueError, match="lora_a"):
        lora_add(out, x, lora_a[:, :4], lora_b, scale, table, meta)
