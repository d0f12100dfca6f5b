"""W8A8 with tensor parallelism over gloo on CPU: a `lmengine quantize w8a8` checkpoint served
with tp=2 equals tp=1 token for token (bit for bit for one request alone); each rank
reads only its int8 rows (colwise, with their scales) or input columns (rowwise, scales
whole) and holds about half the weight bytes; the row-parallel input is quantized with the
per-token scale of the whole input and the int32 accumulators are summed (exact)."""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.distributed.load import load_shard, weight_bytes
from lmengine.distributed.w8a8 import RowParallelW8A8Linear, quantize_with_amax
from lmengine.kernels.w8a8 import per_token_quant_ref
from lmengine.models.w8a8 import W8A8Linear
from lmengine.quant.w8a8 import linear_weight_bytes
from tests.engine_utils import random_prompts, run_threads

CPU = torch.device("cpu")


def test_w8a8_shards_hold_their_slice_only(tiny_w8a8_path):
    full, _ = load_shard(tiny_w8a8_path, "float32", CPU, 0, 1, False)
    shards = [load_shard(tiny_w8a8_path, "float32", CPU, r, 2, False)[0] for r in (0, 1)]
    qkv, o = full.model.layers[1].self_attn.qkv_proj, full.model.layers[1].self_attn.o_proj
    qkv1 = shards[1].model.layers[1].self_attn.qkv_proj
    o1 = shards[1].model.layers[1].self_attn.o_proj
    assert isinstance(qkv1, W8A8Linear) and qkv1.weight.dtype == torch.int8
    assert qkv1.output_sizes == [32, 16, 16]  # 2 of 4 heads, 1 of 2 KV heads (head_dim 16)
    # colwise: rank 1's int8 rows and scales are heads 2..3 of q, KV head 1 of k and v
    rows = [*range(32, 64), *range(64 + 16, 64 + 32), *range(96 + 16, 96 + 32)]
    assert torch.equal(qkv1.weight, qkv.weight[rows])
    assert torch.equal(qkv1.weight_scale, qkv.weight_scale[rows])
    # rowwise: input columns split, per-output-channel scales whole
    assert isinstance(o1, RowParallelW8A8Linear)
    assert torch.equal(o1.weight, o.weight[:, 32:]) and torch.equal(o1.weight_scale, o.weight_scale)
    down0 = shards[0].model.layers[0].mlp.down_proj
    assert torch.equal(down0.weight, full.model.layers[0].mlp.down_proj.weight[:, :64])
    # the smoothed norms are replicated
    norm = full.model.layers[0].input_layernorm.weight
    assert torch.equal(shards[1].model.layers[0].input_layernorm.weight, norm)
    for shard in shards:  # the int8 linears and the whole model: about half per rank
        assert 0.45 < linear_weight_bytes(shard) / linear_weight_bytes(full) < 0.55
        assert 0.45 < weight_bytes(shard) / weight_bytes(full) < 0.55


def test_global_scale_quantization_matches_tp1():
    """Quantizing a shard with the whole row's absmax gives exactly the int8 values of tp=1's
    per-token quantization; with its own absmax it does not."""
    torch.manual_seed(0)
    x = torch.randn(5, 64) * torch.linspace(0.1, 4, 64)  # outliers in the second half
    q_ref, scale_ref = per_token_quant_ref(x)
    amax = x.abs().amax(-1, keepdim=True)
    shards = [quantize_with_amax(part, amax) for part in x.split(32, dim=-1)]
    assert torch.equal(torch.cat(shards, -1), q_ref)
    assert torch.equal(amax / 127, scale_ref)
    local = per_token_quant_ref(x[:, :32])[0]
    assert not torch.equal(local, q_ref[:, :32])


def test_tp2_w8a8_equals_tp1(tiny_w8a8_path):
    cfg = dict(device="cpu", num_gpu_blocks=64, block_size=4)
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True, logprobs=1)
    with Engine.from_pretrained(tiny_w8a8_path, EngineConfig(**cfg)) as ref:
        prompts = random_prompts([1, 6, 17, 30], ref.info.vocab_size, seed=4)
        expected = run_threads(ref, prompts, gen, num_threads=2)
        alone = ref.create_instance().infer(9, prompts[2], gen_config=gen)
    with Engine.from_pretrained(tiny_w8a8_path, EngineConfig(tp=2, **cfg)) as engine:
        got = run_threads(engine, prompts, gen, num_threads=2)
        got_alone = engine.create_instance().infer(9, prompts[2], gen_config=gen)
        per_rank = engine.call(engine.model_agent.rank_weight_bytes)
        engine.check_integrity()
    assert [r.error for r in got] == [None] * len(prompts)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    diffs = [
        abs(a[t] - b[t])
        for r1, r2 in zip(expected, got)
        for t, a, b in zip(r1.token_ids, r1.logprobs, r2.logprobs)
    ]
    # threads make the batch compositions timing-dependent, and float GEMMs round by shape
    assert max(diffs) < 1e-5, max(diffs)
    # one request alone (same batches on both sides): bit-identical, logprobs included
    assert got_alone.token_ids == alone.token_ids and got_alone.logprobs == alone.logprobs
    full, _ = load_shard(tiny_w8a8_path, "float32", CPU, 0, 1, False)
    assert all(0.45 < b / weight_bytes(full) < 0.55 for b in per_rank), per_rank


def test_tp2_refuses_on_the_fly_w8a8_and_lora_with_w8a8(tiny_llama_path, tiny_w8a8_path):
    with pytest.raises(ValueError, match="quantize it first"):
        Engine.from_pretrained(
            tiny_llama_path, EngineConfig(tp=2, device="cpu", quant_policy="w8a8")
        )
    with pytest.raises(ValueError, match="LoRA adapters are not supported together with a w8a8"):
        Engine.from_pretrained(
            tiny_w8a8_path, EngineConfig(tp=2, device="cpu", adapters={"a": "/nowhere"})
        )
