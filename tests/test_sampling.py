"""Sampling: seeded runs reproducible across batches, top_k=1 is greedy, and the sampled
distribution follows temperature and top-p."""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine.sampling import Sampler, banned_ngram_tokens
from lmengine.scheduler import Sequence
from tests.engine_utils import random_prompts, run_threads


def seq(seq_id, cfg, tokens=(1, 2, 3)):
    return Sequence(seq_id, seq_id, list(tokens), cfg)


def draw_many(logits_row, cfg, n):
    """Sample n times from one logits row, as n rows of one batch."""
    sampler = Sampler([], torch.device("cpu"))
    logits = logits_row.repeat(n, 1)
    return torch.tensor(
        [r.token_id for r in sampler.sample(logits, [seq(i, cfg) for i in range(n)])]
    )


def test_temperature_sampling_follows_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    cfg = GenerationConfig(do_sample=True, temperature=0.7)
    counts = torch.bincount(draw_many(logits, cfg, 20000), minlength=5).float()
    expected = (logits / 0.7).softmax(-1) * 20000
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 18.5, f"chi-square {chi2:.1f} with 4 dof (p=0.001 cut-off 18.5)"


def test_extreme_values_give_the_limit_not_nan():
    """Temperatures and penalties whose float32 logits overflow to inf (or 0/0) must give the
    limit distribution (the greedy token), never a NaN draw (which picks token 0)."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 0.0, 2.0]])
    tokens = (1, 2, 3)  # token 1 (the best) is in the history: the penalty sends it to inf
    sampler = Sampler([], torch.device("cpu"))
    for kwargs in (
        dict(do_sample=True, temperature=5e-324),
        dict(do_sample=True, temperature=1e-40, top_k=2, top_p=0.5),
        dict(do_sample=True, temperature=5e-324, top_k=2**70),  # top_k beyond int64
        dict(do_sample=True, repetition_penalty=1e-308),
        dict(repetition_penalty=1e-308),
    ):
        cfg = GenerationConfig(**kwargs)
        [res] = sampler.sample(logits, [seq(0, cfg, tokens)])
        assert res.token_id == 1, kwargs
        probs = sampler.probabilities(logits, [seq(0, cfg, tokens)])
        assert not probs.isnan().any() and probs[0, 1] == 1.0, kwargs


def test_seed_and_length_penalty_bounds():
    GenerationConfig(do_sample=True, random_seed=2**64 - 1)
    with pytest.raises(ValueError, match="random_seed must be <= 18446744073709551615"):
        GenerationConfig(do_sample=True, random_seed=2**64)
    with pytest.raises(ValueError, match="length_penalty must be <= 20"):
        GenerationConfig(num_beams=2, length_penalty=1e308)


def test_top_p_keeps_only_the_nucleus_renormalised():
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    cfg = GenerationConfig(do_sample=True, top_p=0.75)
    counts = torch.bincount(draw_many(probs.log(), cfg, 20000), minlength=4).float()
    assert counts[2] == 0 and counts[3] == 0
    expected = torch.tensor([0.5, 0.3]) / 0.8 * 20000
    chi2 = ((counts[:2] - expected) ** 2 / expected).sum()
    assert chi2 < 10.8, f"chi-square {chi2:.1f} with 1 dof"


def test_top_k_filters():
    cfg = GenerationConfig(do_sample=True, top_k=2)
    drawn = draw_many(torch.tensor([0.0, 3.0, 2.9, -5.0]), cfg, 2000)
    assert set(drawn.tolist()) == {1, 2}


def test_temperature_top_k_top_p_match_transformers_warpers():
    """Rows with different settings in one batch, each equal to transformers' warpers applied
    in its order: temperature, top-k, then top-p over what top-k kept."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(3)
    logits = torch.randn(4, 40) * 3
    cfgs = [
        GenerationConfig(do_sample=True, temperature=0.8, top_k=5, top_p=0.6),
        GenerationConfig(do_sample=True, temperature=1.5, top_k=12),
        GenerationConfig(do_sample=True, top_p=0.9),
        GenerationConfig(do_sample=True, temperature=0.5, top_k=3, top_p=0.99),
    ]
    for only_topk_rows in (False, True):  # all rows with a top-k take the top-k fast path
        rows = [0, 1, 3] if only_topk_rows else [0, 1, 2, 3]
        ours = Sampler([], torch.device("cpu"))._warp(logits[rows], [cfgs[i] for i in rows])
        for out_row, i in enumerate(rows):
            c, row = cfgs[i], logits[i : i + 1]
            row = TemperatureLogitsWarper(c.temperature)(None, row)
            if c.top_k:
                row = TopKLogitsWarper(c.top_k)(None, row)
            if c.top_p < 1:
                row = TopPLogitsWarper(c.top_p)(None, row)
            kept = row[0] > float("-inf")
            assert torch.equal(ours[out_row] > float("-inf"), kept), i
            torch.testing.assert_close(ours[out_row][kept], row[0][kept])


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(2)
    logits = torch.randn(2, 50)
    histories = [[3, 7, 7, 12], [0, 49, 5]]
    cfg = GenerationConfig(repetition_penalty=1.3)
    sampler = Sampler([], torch.device("cpu"))
    ours = sampler._apply_penalties(
        logits.clone(), [seq(i, cfg, h) for i, h in enumerate(histories)]
    )
    proc = RepetitionPenaltyLogitsProcessor(1.3)
    for i, h in enumerate(histories):
        ref = proc(torch.tensor([h]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], ref)


def test_no_repeat_ngram_bans_completions():
    assert sorted(banned_ngram_tokens([1, 2, 3, 1, 2], 3)) == [3]
    assert banned_ngram_tokens([1, 2, 3], 0) == []
    cfg = GenerationConfig(no_repeat_ngram_size=2)
    logits = torch.zeros(1, 10)
    logits[0, 5] = 10.0
    out = Sampler([], torch.device("cpu")).sample(logits, [seq(0, cfg, [4, 5, 4])])
    assert out[0].token_id != 5


def test_min_new_tokens_masks_eos():
    cfg = GenerationConfig(min_new_tokens=2)
    logits = torch.zeros(1, 10)
    logits[0, 9] = 10.0
    out = Sampler([9], torch.device("cpu")).sample(logits, [seq(0, cfg)])
    assert out[0].token_id != 9


def test_logprobs_are_raw_and_include_top_n():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    cfg = GenerationConfig(logprobs=2)
    res = Sampler([], torch.device("cpu")).sample(logits, [seq(0, cfg)])[0]
    ref = logits.log_softmax(-1)[0]
    assert res.token_id == 2
    assert res.logprob == pytest.approx(float(ref[2]))
    assert set(res.top_logprobs) == {2, 1}


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    eng = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=512))
    yield eng
    eng.close()


def test_seeded_sampling_is_reproducible_across_batches(engine):
    vocab = engine.info.vocab_size
    prompts = random_prompts([7, 30, 3, 12, 20, 5], vocab, seed=3)
    seeded = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.5, random_seed=42)
    # the probe (prompt 0) alone, then inside two different batches
    alone = engine.create_instance().infer(0, prompts[0], gen_config=seeded).token_ids
    other = GenerationConfig(max_new_tokens=16, do_sample=True, top_p=0.9)
    batch_a = run_threads(engine, prompts[:3], [seeded, other, other])
    batch_b = run_threads(engine, prompts, [seeded] + [other] * 5)
    assert batch_a[0].token_ids == alone and batch_b[0].token_ids == alone
    engine.check_integrity()


def test_top_k_1_equals_greedy(engine):
    prompts = random_prompts([9, 25], engine.info.vocab_size, seed=4)
    greedy = run_threads(engine, prompts, GenerationConfig(max_new_tokens=12))
    topk1 = run_threads(
        engine,
        prompts,
        GenerationConfig(max_new_tokens=12, do_sample=True, top_k=1, temperature=2.0),
    )
    assert [r.token_ids for r in greedy] == [r.token_ids for r in topk1]


def test_engine_logprobs(engine):
    p = random_prompts([6], engine.info.vocab_size, seed=5)[0]
    r = engine.create_instance().infer(
        1, p, gen_config=GenerationConfig(max_new_tokens=5, logprobs=3)
    )
    assert len(r.logprobs) == 5
    for tok, lp in zip(r.token_ids, r.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_greedy_is_torch_argmax_with_ties_infs_and_nans(compiled, monkeypatch):
    """The compiled argmax takes the first maximum, like torch's; a NaN row falls back to the
    best non-NaN token."""
    from lmengine.engine.sampling import argmax_rows, greedy
    from lmengine.kernels import cpu_ext

    if not compiled:
        monkeypatch.setattr(cpu_ext, "load", lambda: None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 49152, generator=gen)
    x[1, 7] = x[1, 40000] = x[1].max() + 1.0  # a tie: the first one wins
    x[2] = float("-inf")  # all -inf: index 0, as torch
    x[3, 5] = float("inf")
    x[4, 9] = float("nan")  # NaN counts as the maximum in argmax ...
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    tokens = greedy(x)  # ... and greedy skips it
    assert tokens[4] == x[4].nan_to_num(nan=float("-inf")).argmax()
    assert torch.equal(tokens[[0, 1, 2, 3, 5]], x[[0, 1, 2, 3, 5]].argmax(-1))


@pytest.mark.parametrize("width", [1, 15, 16, 31, 32, 33, 65, 1000, 49157])
def test_the_compiled_argmax_is_torch_argmax_at_every_width(width):
    """The compiled argmax keeps a maximum per vector lane and merges the lanes and the tail
    at the end: the first maximum must win wherever the ties fall (in one lane, across lanes,
    in the tail), and a NaN anywhere must win as in torch."""
    from lmengine.kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("needs the compiled CPU kernels")
    gen = torch.Generator().manual_seed(width)
    for trial in range(20):
        x = torch.randint(-3, 3, (6, width), generator=gen).float()  # ties everywhere
        x[1] = float("-inf")
        x[1, width // 2] = -1e30
        x[2, (3 * width) // 4] = float("nan")
        x[3, width - 1] = x[3, 0] = float("inf")
        x[4] = -0.0
        x[4, width // 3] = 0.0  # -0.0 == 0.0: the first of them wins
        x[5, torch.randint(0, width, (3,), generator=gen)] = 7.0
        assert torch.equal(ext.argmax_rows(x), x.argmax(-1)), trial
