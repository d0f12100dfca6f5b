"""The compiled gather-free decode kernel (kernels/csrc/cpu_ops.cpp) against the references."""

from __future__ import annotations

import pytest
import torch

from lmengine.kernels import cpu_ext, paged_attention
from lmengine.kernels.paged_attention import paged_attention_cpu, paged_attention_ref
from tests.kernels.helpers import dense_causal_attention, make_paged_batch


@pytest.mark.parametrize("kv_lens", [[1], [5, 17, 32], [16, 1, 47, 64, 3]])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    "heads,head_dim", [((4, 4), 16), ((9, 3), 64), ((8, 1), 32), ((4, 2), 128)]
)
def test_decode_kernel_matches_references(ext, kv_lens, block_size, heads, head_dim, threads):
    num_heads, num_kv_heads = heads
    q_lens = [1] * len(kv_lens)
    q, kc, vc, meta, dk, dv = make_paged_batch(
        q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, seed=len(kv_lens)
    )
    scale = head_dim**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale).float()
    torch.testing.assert_close(paged_attention_ref(q, kc, vc, meta, scale), expected)
    tables = meta.block_tables.contiguous()
    out = ext.paged_decode_attention(q, kc, vc, tables, meta.kv_lens, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_engine_path_uses_the_kernel_for_decodes_in_a_mixed_batch(ext, monkeypatch):
    q_lens, kv_lens = [1, 6, 1, 3], [30, 6, 2, 12]
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, 6, 2, 32, 4, seed=7)
    calls = []
    real = ext.paged_decode_attention

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(ext, "paged_decode_attention", spy, raising=False)
    scale = 32**-0.5
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale).float()
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, scale), expected)
    assert calls == [2], "the two decodes should go through the kernel in one call"


def test_decode_kernel_rejects_bad_input(ext):
    q, kc, vc, meta, *_ = make_paged_batch([1], [5], 4, 2, 16, 4)
    tables = meta.block_tables.contiguous()
    with pytest.raises(RuntimeError, match="float32"):
        ext.paged_decode_attention(q.double(), kc, vc, tables, meta.kv_lens, 1.0)
    with pytest.raises(RuntimeError, match="kv_len"):
        ext.paged_decode_attention(q, kc, vc, tables, meta.kv_lens + 100, 1.0)


def test_torch_path_without_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_ext, "load", lambda: None)
    q_lens, kv_lens = [1, 1], [9, 20]
    q, kc, vc, meta, dk, dv = make_paged_batch(q_lens, kv_lens, 4, 2, 16, 4, seed=2)
    scale = 0.25
    expected = dense_causal_attention(q, dk, dv, q_lens, kv_lens, scale).float()
    torch.testing.assert_close(paged_attention_cpu(q, kc, vc, meta, scale), expected)


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (5, 0.0), (100, 0.0), (0, 2.0), (7, 1.5)])
def test_decode_kernel_sliding_window_and_softcap(ext, window, softcap):
    kv_lens = [1, 9, 16, 33]
    q, kc, vc, meta, dk, dv = make_paged_batch([1] * 4, kv_lens, 6, 2, 16, 4, seed=5)
    scale = 0.25
    expected = []
    for b, kv_len in enumerate(kv_lens):
        k = dk[b].double().repeat_interleave(3, dim=1)  # [kv_len, heads, d]
        v = dv[b].double().repeat_interleave(3, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if window:
            scores[:, : max(0, kv_len - window)] = float("-inf")
        expected.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    tables = meta.block_tables.contiguous()
    out = ext.paged_decode_attention(q, kc, vc, tables, meta.kv_lens, scale, window, softcap)
    torch.testing.assert_close(out, torch.stack(expected).float(), rtol=1e-5, atol=1e-5)


def test_old_builds_are_pruned_but_not_one_in_use(tmp_path):
    import fcntl
    import os

    folders = []
    for i in range(7):  # current = the newest; then six older ones
        folder = tmp_path / f"build{i}"
        folder.mkdir()
        (folder / "module.so").write_text("x")
        (folder / "build.flock").touch()
        os.utime(folder, (1000 + i, 1000 + i))  # after the files: they touch the folder
        folders.append(folder)
    current = folders[-1]
    with open(folders[0] / "build.flock", "a") as held:  # another process is building it
        fcntl.flock(held, fcntl.LOCK_EX)
        cpu_ext._prune_old_builds(current, keep=3)
    kept = sorted(p.name for p in tmp_path.iterdir())
    # the three newest other builds and the locked one stay; build1 and build2 go
    assert kept == ["build0", "build3", "build4", "build5", "build6"]
