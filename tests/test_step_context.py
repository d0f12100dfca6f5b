"""The packed step context (models/context.py): a step of decodes alone takes its own short
path, which must give what the general path gives."""

from __future__ import annotations

import random

import pytest
import torch

from lmengine.models.context import build_step_context

BLOCK = 16


def _decodes(n: int, seed: int):
    rng = random.Random(seed)
    free = list(range(4 * n + 8))
    rng.shuffle(free)
    tables, starts = [], []
    for _ in range(n):
        start = rng.randrange(0, 60)  # the position the decode writes
        blocks = start // BLOCK + 1 + rng.randrange(2)  # a spare block now and then
        tables.append([free.pop() for _ in range(blocks)])
        starts.append(start)
    needs = [rng.random() < 0.8 for _ in range(n)]
    needs[0] = True
    return tables, starts, needs


@pytest.mark.parametrize("n", [1, 7, 64])
def test_a_decode_step_packs_as_the_general_path_does(n):
    tables, starts, needs = _decodes(n, seed=n)
    args = ([1] * n, starts, tables)
    fast = build_step_context(*args, needs, BLOCK, [], torch.device("cpu"))
    # per-sequence logits counts send the same step down the general path
    general = build_step_context(
        *args, needs, BLOCK, [], torch.device("cpu"), 0, [int(x) for x in needs]
    )
    for name in ("positions", "slot_mapping", "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype == torch.long, name
        assert torch.equal(a, b), name
    expected_slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, starts)]
    assert fast.slot_mapping.tolist() == expected_slots
    assert torch.equal(fast.attn_meta.block_tables, general.attn_meta.block_tables)
    width = max(len(t) for t in tables)
    assert fast.attn_meta.block_tables.shape == (n, width)
    assert fast.attn_meta.block_tables[0, : len(tables[0])].tolist() == tables[0]
