"""Mixture-of-experts kernels against the dense per-slot reference: the compiled CPU layer
(csrc/moe_ops.cpp) through each of its kernels, the Python loop over experts, and the Triton
grouped GEMM (under TRITON_INTERPRET=1 on CPU); in float32 and bfloat16, with and without
biases, for each activation the compiled layer computes. And the reference against
transformers' own Mixtral, Qwen3-MoE and gpt-oss expert modules."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from lmengine.kernels import cpu_ext
from lmengine.kernels.activation import ClampedSwiGLU, GatedActivation
from lmengine.kernels.moe import (
    fused_moe,
    fused_moe_compiled,
    fused_moe_cpu,
    fused_moe_ref,
    native_activation,
    pack_experts,
)

BF16 = torch.bfloat16

SHAPES = {
    # name: (num_tokens, num_experts, top_k, hidden, inter)
    "decode": (1, 4, 2, 32, 48),
    "small": (7, 4, 2, 32, 48),
    "many_tokens": (40, 8, 2, 24, 40),  # several row tiles per expert, dims not powers of 2
    "top1": (9, 3, 1, 16, 16),
    "unused_experts": (3, 16, 2, 32, 32),  # most experts get no token
    "e128_top8_one_token": (1, 128, 8, 64, 48),  # Qwen3-MoE's routing: 120 experts idle
    "e128_top8": (70, 128, 8, 64, 48),  # 560 slots over 128 experts, a few empty
    "wide": (150, 4, 2, 160, 96),  # ~75 rows per expert: several 32-row chunks, hidden > 128
    # bfloat16 on AMX tiles: gate/up on 16-row weight groups plus 8 rows on the dot products
    "tile_tail_gate_up": (20, 4, 2, 64, 40),
    # and down's second block of output columns: 16 rows on the tiles, 8 on the dot products
    "tile_tail_down": (20, 4, 2, 88, 64),
}
# the activations the compiled layer computes; ClampedSwiGLU's limit is low enough that the
# clamps bite on these N(0, ~2) gate/up values
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": torch.nn.GELU(approximate="tanh"),
    "clamped_swiglu": ClampedSwiGLU(alpha=1.702, limit=1.5),
}
# The compiled layer's kernels: dot products on the weights as stored (an expert's rows below
# amx_rows), for bfloat16 the AMX tiles (on AMX builds; else the dot products again) and the
# portable kernels (no AVX512-BF16 or AMX: what an AVX2 CPU runs)
KERNELS = {
    "dot": {"amx_rows": 1 << 30},
    "amx": {"amx_rows": 1},
    "portable": {"amx_rows": 1, "use_bf16_units": False},
}


def _inputs(num_tokens, num_experts, top_k, hidden, inter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, -1)
    return x, w_gate_up, w_down, weights / weights.sum(-1, keepdim=True), ids


def _layer(name, dtype, has_bias, seed=0):
    """(args, biases): fused_moe's positional arguments in `dtype` (router weights float32) and
    its bias keywords (None without)."""
    num_tokens, num_experts, top_k, hidden, inter = SHAPES[name]
    x, w_gate_up, w_down, weights, ids = _inputs(*SHAPES[name], seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    biases = {"b_gate_up": None, "b_down": None}
    if has_bias:
        biases["b_gate_up"] = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype)
        biases["b_down"] = torch.randn(num_experts, hidden, generator=gen).to(dtype)
    return (x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights, ids), biases


def _assert_matches_reference(got, args, act, biases):
    """float32: the float32 reference, tight. bfloat16: within 2 % of the output's scale of the
    bfloat16 reference (both round each GEMM output, the activation and the weighted expert
    outputs to bfloat16; the kernels accumulate in float32 in another order and sum the top-k
    outputs in float32 where the reference adds them in bfloat16)."""
    expected = fused_moe_ref(*args, act, **biases)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        tol = 2e-2 * float(expected.float().abs().max())
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tol)


# float32 runs the dot products whatever the units
DTYPE_KERNELS = [(torch.float32, "dot")] + [(BF16, k) for k in KERNELS]


@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize(
    "dtype, kernel", DTYPE_KERNELS, ids=[f"{str(d)[6:]}-{k}" for d, k in DTYPE_KERNELS]
)
@pytest.mark.parametrize("name", list(SHAPES))
def test_compiled_layer_matches_reference(ext, name, dtype, kernel, act, has_bias):
    args, biases = _layer(name, dtype, has_bias)
    got = fused_moe_compiled(*args, ACTIVATIONS[act], **biases, **KERNELS[kernel])
    assert got is not None
    _assert_matches_reference(got, args, ACTIVATIONS[act], biases)


@pytest.mark.parametrize(
    "dtype, kernel", DTYPE_KERNELS, ids=[f"{str(d)[6:]}-{k}" for d, k in DTYPE_KERNELS]
)
def test_compiled_layer_on_one_and_two_threads(ext, threads, dtype, kernel):
    """The tasks are shared through a counter: any split between the threads gives the same
    result, to the bit (each task's sums run in a fixed order)."""
    args, biases = _layer("e128_top8", dtype, has_bias=True, seed=5)
    act = ACTIVATIONS["clamped_swiglu"]
    got = fused_moe_compiled(*args, act, **biases, **KERNELS[kernel])
    _assert_matches_reference(got, args, act, biases)
    torch.set_num_threads(1)
    one_thread = fused_moe_compiled(*args, act, **biases, **KERNELS[kernel])
    torch.testing.assert_close(got, one_thread, rtol=0, atol=0)


@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_python_loop_matches_reference(name, dtype, act, has_bias):
    args, biases = _layer(name, dtype, has_bias, seed=1)
    got = fused_moe_cpu(*args, ACTIVATIONS[act], **biases)
    _assert_matches_reference(got, args, ACTIVATIONS[act], biases)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["small", "unused_experts", "e128_top8"])
def test_dispatch_takes_each_cpu_path(cpu_path, name, dtype):
    """fused_moe on the CPU: the compiled layer where built, the Python loop (on packed weights
    where pack_experts packs) without it; an activation the compiled layer does not compute
    (ReLU, a GatedActivation of the caller's) takes the Python loop either way."""
    args, biases = _layer(name, dtype, has_bias=True, seed=2)
    packed_gate_up, packed_down = pack_experts(args[1]), pack_experts(args[2])
    if cpu_path == "compiled":
        assert packed_gate_up is None and packed_down is None  # nothing to prepare
    packed = None if packed_gate_up is None else (packed_gate_up, packed_down)
    for act in (F.silu, ACTIVATIONS["clamped_swiglu"], F.relu, _SquaredGate()):
        got = fused_moe(*args, act, packed, **biases)
        _assert_matches_reference(got, args, act, biases)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_slots_of_id_minus_one_add_nothing(cpu_path, dtype):
    """Under tensor parallelism a rank's slots of other ranks' experts have id -1: each path
    (the compiled layer, the Python loop, and for an activation the compiled layer does not
    know the loop again) gives the mixture without them."""
    args, biases = _layer("e128_top8", dtype, has_bias=True, seed=6)
    x, w_gate_up, w_down, weights, ids = args
    none = torch.rand(ids.shape, generator=torch.Generator().manual_seed(6)) < 0.5
    none[0] = True  # a token with no expert at all: zeros
    dropped = (x, w_gate_up, w_down, weights.masked_fill(none, 0.0), ids.masked_fill(none, 0))
    for act in (F.silu, _SquaredGate()):
        got = fused_moe(x, w_gate_up, w_down, weights, ids.masked_fill(none, -1), act, **biases)
        _assert_matches_reference(got, dropped, act, biases)
        assert not got[0].any()


def test_prompt_sized_batches_take_the_python_loop(monkeypatch):
    """From _LOOP_ROWS rows per expert on average the per-expert GEMMs serve the batch."""
    import lmengine.kernels.moe as moe

    def refuse(*args, **kwargs):
        raise AssertionError("the compiled layer took a prompt-sized batch")

    _, biases = _layer("small", torch.float32, has_bias=True, seed=4)  # 4 experts, top-2
    args = _inputs(moe._LOOP_ROWS * 4 // 2, 4, 2, 32, 48, seed=4)
    monkeypatch.setattr(moe, "fused_moe_compiled", refuse)
    _assert_matches_reference(fused_moe(*args, F.silu, **biases), args, F.silu, biases)


class _SquaredGate(GatedActivation):
    """A gated activation the compiled layer does not know."""

    def __call__(self, gate, up):
        return gate * gate * up


def test_native_activation_recognises_exact_types_only():
    from transformers.activations import ACT2FN

    assert native_activation(F.silu)[0] == native_activation(ACT2FN["silu"])[0] == 0
    assert native_activation(torch.nn.SiLU())[0] == 0
    assert native_activation(ACT2FN["gelu_pytorch_tanh"])[0] == 1
    assert native_activation(functools.partial(F.gelu, approximate="tanh"))[0] == 1
    assert native_activation(ClampedSwiGLU(1.702, 7.0)) == (2, 1.702, 7.0)
    # another formula, or one transformers computes its own way: not the compiled kernel's
    for other in (F.gelu, torch.nn.GELU(), ACT2FN["gelu_python_tanh"], ACT2FN["gelu_new"], F.relu):
        assert native_activation(other) is None
    assert native_activation(_SquaredGate()) is None


def test_clamped_swiglu_is_gpt_oss_apply_gate():
    """transformers' GptOssExperts._apply_gate on its interleaved gate/up columns, bit for bit
    in float32 and bfloat16 (the same torch ops in the same order)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=16, intermediate_size=24, num_local_experts=2)
    experts = GptOssExperts(cfg)
    act = ClampedSwiGLU(alpha=experts.alpha, limit=experts.limit)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, BF16):
        gate_up = (torch.randn(33, 48, generator=gen) * 6).to(dtype)  # past the limit of 7
        expected = experts._apply_gate(gate_up)
        got = act(gate_up[..., ::2], gate_up[..., 1::2])
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_clamped_swiglu_validates():
    with pytest.raises(ValueError, match="limit"):
        ClampedSwiGLU(alpha=1.702, limit=0.0)
    with pytest.raises(ValueError, match="alpha"):
        ClampedSwiGLU(alpha=float("nan"), limit=7.0)


@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("name", ["decode", "many_tokens", "top1", "e128_top8"])
def test_triton_matches_reference(triton_device, name, act, has_bias):
    from lmengine.kernels.triton.moe import fused_moe_triton

    args, biases = _layer(name, torch.float32, has_bias, seed=3)
    expected = fused_moe_ref(*args, ACTIVATIONS[act], **biases)
    dev = triton_device
    on_dev = {k: None if v is None else v.to(dev) for k, v in biases.items()}
    got = fused_moe_triton(*(t.to(dev) for t in args), ACTIVATIONS[act], **on_dev)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_align_by_expert_pads_each_run():
    from lmengine.kernels.triton.moe import align_by_expert

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # slots 0..5
    slots, tile_expert = align_by_expert(ids, 4, 4)
    sentinel = ids.numel()
    assert tile_expert.tolist() == [0, 1, 2]  # expert 3 has no token, no tile
    assert slots.tolist() == [1, 4, sentinel, sentinel, 3] + [sentinel] * 3 + [0, 2, 5, sentinel]


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_matches_transformers_mixtral_experts(dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4)
    experts = MixtralExperts(cfg).to(dtype)
    x, wgu, wd, weights, ids = _inputs(11, 4, 2, 32, 48, seed=2)
    x, wgu, wd = x.to(dtype), wgu.to(dtype), wd.to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(wgu)
        experts.down_proj.copy_(wd)
        expected = experts(x, ids, weights.to(dtype))
    _assert_close_to_transformers(fused_moe(x, wgu, wd, weights, ids, experts.act_fn), expected)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_matches_transformers_qwen3_moe_block(dtype):
    """Qwen3-MoE's sparse block (router included: softmax, top-8 of 32, renormalised)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=32,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(1, 13, 64).to(dtype)
    with torch.no_grad():
        expected = block(x)[0]
        _, weights, ids = block.gate(x[0])
    got = fused_moe(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids, F.silu)
    _assert_close_to_transformers(got, expected)


def gpt_oss_layout(experts) -> dict[str, torch.Tensor]:
    """gpt-oss's experts in fused_moe's layout: gate_up_proj [E, hidden, 2 * inter] with gate and
    up interleaved by column -> w_gate_up [E, 2 * inter, hidden], gate rows first; down_proj
    [E, inter, hidden] -> w_down [E, hidden, inter]; the gate/up bias de-interleaved alike."""
    gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias
    w_gate_up = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    return {
        "w_gate_up": w_gate_up.contiguous(),
        "w_down": experts.down_proj.transpose(1, 2).contiguous(),
        "b_gate_up": torch.cat([bias[..., ::2], bias[..., 1::2]], dim=-1).contiguous(),
        "b_down": experts.down_proj_bias.contiguous(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_matches_transformers_gpt_oss_mlp(dtype):
    """gpt-oss's MLP (router with bias, top-4 of 8, biased experts, ClampedSwiGLU) from its
    weights converted to fused_moe's layout."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(
        hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=4
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    mlp = GptOssMLP(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)  # gate/up values past swiglu_limit = 7 now and then
    x = torch.randn(1, 21, 64).to(dtype)
    with torch.no_grad():
        expected = mlp(x)[0][0]
        _, weights, ids = mlp.router(x[0])
    weights_layout = gpt_oss_layout(mlp.experts)
    act = ClampedSwiGLU(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    got = fused_moe(
        x[0],
        weights_layout["w_gate_up"],
        weights_layout["w_down"],
        weights,
        ids,
        act,
        b_gate_up=weights_layout["b_gate_up"],
        b_down=weights_layout["b_down"],
    )
    _assert_close_to_transformers(got, expected)


def _assert_close_to_transformers(got, expected):
    """float32 to 1e-5; bfloat16 within 2 % of the output's scale (transformers adds the top-k
    expert outputs into a bfloat16 sum, expert by expert)."""
    assert got.dtype == expected.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        tol = 2e-2 * float(expected.float().abs().max())
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=tol)


def test_non_contiguous_weights_take_the_python_loop():
    args, biases = _layer("small", torch.float32, has_bias=True)
    x, wgu, wd, weights, ids = args
    wgu_t = wgu.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert fused_moe_compiled(x, wgu_t, wd, weights, ids, F.silu, **biases) is None
    got = fused_moe(x, wgu_t, wd, weights, ids, F.silu, **biases)
    _assert_matches_reference(got, args, F.silu, biases)


def test_empty_batch():
    args, biases = _layer("small", torch.float32, has_bias=True)
    x, wgu, wd, weights, ids = args
    out = fused_moe(x[:0], wgu, wd, weights[:0], ids[:0], F.silu, **biases)
    assert out.shape == (0, x.shape[1])


def test_rejects_bad_shapes():
    x, wgu, wd, weights, ids = _inputs(*SHAPES["small"])
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe(x[:, :8], wgu, wd, weights, ids, F.silu)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, wgu, wd, weights[:, :1], ids, F.silu)
    with pytest.raises(ValueError, match="b_gate_up"):
        fused_moe(x, wgu, wd, weights, ids, F.silu, b_gate_up=torch.zeros(4, 48))
    with pytest.raises(ValueError, match="b_down"):
        fused_moe(x, wgu, wd, weights, ids, F.silu, b_down=torch.zeros(4, 31))


def test_compiled_layer_rejects_out_of_range_expert_ids(ext):
    x, wgu, wd, weights, ids = _inputs(*SHAPES["small"])
    ids = ids.clone()
    for bad in (4, -2):  # 4 experts: ids 0..3, or -1 for none
        ids[3, 1] = bad
        with pytest.raises(RuntimeError, match="out of range"):
            fused_moe(x, wgu, wd, weights, ids, F.silu)
    assert cpu_ext.load() is not None


def _advised_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's data carries madvise(MADV_HUGEPAGE) (smaps' "hg")."""
    import re

    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= addr < int(span[2], 16)
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()
    return False


def test_on_huge_pages_copies_large_cpu_tensors_only(monkeypatch):
    from lmengine.kernels import huge_pages

    big = torch.randn(3, 512, 1024)  # 6 MiB
    placed = huge_pages.on_huge_pages(big)
    if not huge_pages.huge_pages_available():
        assert placed is big
        pytest.skip("no transparent huge pages on this system")
    assert placed.data_ptr() != big.data_ptr() and torch.equal(placed, big)
    assert placed.is_contiguous() and placed.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _advised_for_huge_pages(placed) and not _advised_for_huge_pages(big)
    small = torch.randn(1000)
    assert huge_pages.on_huge_pages(small) is small
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    assert huge_pages.on_huge_pages(big) is big


def test_patched_block_moves_its_experts_to_huge_pages():
    """Qwen3-MoE's patched block: the experts move at the first forward, the output does not."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from lmengine.kernels.huge_pages import huge_pages_available
    from lmengine.models.qwen import PatchedQwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).eval().requires_grad_(False)
    for p in block.parameters():
        p.normal_(0, 0.05)
    x = torch.randn(5, 256)
    experts = block.experts
    weights, ids = block.gate(x)[1:]
    expected = fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, F.silu)
    before = experts.gate_up_proj.data_ptr()
    block.__class__ = PatchedQwen3MoeSparseMoeBlock
    block.lmengine_post_patch()
    got = block(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert block.experts_placed
    if huge_pages_available():  # gate_up [8, 256, 256] float32: 2 MiB
        assert experts.gate_up_proj.data_ptr() != before
        assert _advised_for_huge_pages(experts.gate_up_proj)
