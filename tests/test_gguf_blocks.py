"""The quantized blocks of SmolLM2's shipped Q4_1 GGUF, read under the converted model's
parameter names: every one expands bit for bit to the float32 weight the engine loads today
(query and key rows put back in transformers' order), and the weight-only kernel computes
with them what the float32 linear computes; files it cannot read are clear errors."""

from __future__ import annotations

import pytest
import torch

from lmengine.engine.gguf_blocks import check_blocks, read_gguf_blocks
from lmengine.engine.loader import default_gguf_path
from lmengine.kernels.gguf import QTYPES, gguf_linear

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2_blocks():
    return read_gguf_blocks(str(default_gguf_path()))


@pytest.fixture(scope="module")
def smollm2_state(smollm2_path):
    from safetensors.torch import load_file

    return load_file(f"{smollm2_path}/model.safetensors")


def test_every_block_weight_expands_to_the_converted_weight(smollm2_blocks, smollm2_state):
    types = sorted({w.qtype for w in smollm2_blocks.values()})
    assert len(smollm2_blocks) == 30 * 7 + 1  # seven linears per layer and the embedding
    assert types == [QTYPES["Q4_1"], QTYPES["Q8_0"]]
    assert smollm2_blocks["model.embed_tokens.weight"].qtype == QTYPES["Q8_0"]
    check_blocks(smollm2_blocks, smollm2_state)  # raises on the first weight that differs
    q = smollm2_blocks["model.layers.0.self_attn.q_proj.weight"]
    assert (q.out_features, q.in_features) == (576, 576)


def test_rows_out_of_place_are_caught(smollm2_blocks, smollm2_state):
    """The check compares whole weights: two query rows swapped (as a missed reordering of
    the rotary layout would leave them) do not pass."""
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = smollm2_blocks[name]
    swapped = weight.blocks.clone()
    swapped[[1, 32]] = swapped[[32, 1]]
    bad = type(weight)(swapped, weight.qtype, weight.in_features)
    with pytest.raises(ValueError, match="does not expand"):
        check_blocks({name: bad}, smollm2_state)
    with pytest.raises(ValueError, match="no counterpart"):
        check_blocks({"model.layers.99.mlp.up_proj.weight": weight}, smollm2_state)


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_the_kernel_on_real_blocks_equals_the_float_linear(smollm2_blocks, smollm2_state, rows):
    name = "model.layers.5.mlp.down_proj.weight"
    weight = smollm2_blocks[name]
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
    got = gguf_linear(x, weight.blocks, weight.qtype, weight.in_features)
    ref = x.double() @ smollm2_state[name].double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


def test_a_file_of_another_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "qwen.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tensor("blk.0.attn_q.weight", torch.zeros(4, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Llama-architecture files only, this one is 'qwen2'"):
        read_gguf_blocks(str(path))


@pytest.mark.parametrize("keep", [10, 1000, 0.5])
def test_a_truncated_file_is_a_clear_error(tmp_path, keep):
    data = default_gguf_path().read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match="is not a complete GGUF file"):
        read_gguf_blocks(str(path))
