"""Speculative decoding on a tiny random Llama.

- Greedy output equals transformers token for token with every proposer (prompt lookup, a
  near copy of the model as draft, the model itself, a smaller model of another shape),
  under preemption by recompute and by swap, with prefix caching, and with drafts that a
  test proposer corrupts on purpose (so acceptance stops at known places, and stop tokens
  fall inside accepted runs).
- Sampling keeps the target's distribution: `rejection_sample` against the exact
  distribution (with a negative control showing the test has power), and the engine's
  first three sampled tokens against probabilities computed with transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig, SpeculativeConfig
from lmengine.engine.speculative import Drafts, NgramProposer, rejection_sample
from tests.conftest import save_tiny_llama
from tests.engine_utils import random_prompts
from tests.hf_reference import hf_greedy
from tests.test_swap import final_responses, submit_at_once

NEW = 20


def perturbed_copy(path: str, out: Path, noise: float, seed: int = 1) -> str:
    """The model at `path` with Gaussian noise of `noise` x each weight's std added: a draft
    that agrees with it often, not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn(w.shape, generator=gen) * w.std() * noise)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def drafts(tiny_llama_path, tmp_path_factory, smollm2_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    small.update(num_attention_heads=2, num_key_value_heads=1)
    return {
        "near": perturbed_copy(tiny_llama_path, root / "near", 0.02),
        "self": tiny_llama_path,
        "small": save_tiny_llama(root / "small", smollm2_path, seed=5, **small),
    }


@pytest.fixture(scope="module")
def case(tiny_llama_path):
    prompts = random_prompts([3, 17, 9, 30, 5, 22, 12, 40], 2000, seed=11)
    prompts += [[7, 8, 9] * 6, [100, 200] * 9]  # repetitive: prompt lookup finds n-grams
    return tiny_llama_path, prompts, hf_greedy(tiny_llama_path, prompts, NEW, ignore_eos=True)


def speculative(kind: str, drafts: dict[str, str], k: int = 3) -> SpeculativeConfig:
    if kind == "ngram":
        return SpeculativeConfig("ngram", num_speculative_tokens=k)
    return SpeculativeConfig("draft_model", num_speculative_tokens=k, draft_model=drafts[kind])


@pytest.mark.parametrize("eviction", ["recompute", "swap"])
@pytest.mark.parametrize("kind", ["ngram", "near", "self", "small"])
def test_greedy_equals_transformers_under_preemption(case, drafts, kind, eviction):
    path, prompts, expected = case
    config = EngineConfig(
        block_size=4,
        num_gpu_blocks=36,  # a few sequences at once: preemption
        num_cpu_blocks=24 if eviction == "swap" else 0,
        eviction_type=eviction,
        enable_prefix_caching=kind == "near",
        speculative=speculative(kind, drafts),
    )
    with Engine.from_pretrained(path, config) as engine:
        got = final_responses(
            submit_at_once(engine, prompts, GenerationConfig(NEW, ignore_eos=True))
        )
        for i, (r, exp) in enumerate(zip(got, expected)):
            assert r.finish_reason == "length", r.error
            assert r.token_ids == exp, f"{kind}: prompt {i} differs"
        engine.check_integrity()
        s = engine.stats()
        assert s["num_free_blocks"] == s["num_total_blocks"]
        assert s["num_preemptions"] > 0, s
        if eviction == "swap":
            assert s["num_swap_outs"] > 0 and s["num_free_cpu_blocks"] == s["num_total_cpu_blocks"]
        spec = s["speculative"]
        assert spec["num_draft_tokens"] > 0
        assert sum(r.num_draft_tokens for r in got) <= spec["num_draft_tokens"]
        if kind == "self":  # the model agrees with itself
            assert spec["acceptance_rate"] > 0.95, spec
        if kind == "near":
            assert 0.2 < spec["acceptance_rate"] < 1.0, spec


class OracleProposer:
    """Drafts the expected continuation, with the token at every `corrupt_every`-th draft
    position replaced: acceptance must stop exactly there."""

    def __init__(self, prompts: list[list[int]], expected: list[list[int]], corrupt_every: int):
        self.full = {tuple(p): p + e for p, e in zip(prompts, expected)}
        self.corrupt_every = corrupt_every
        self.proposed: list[tuple[list[int], list[int]]] = []  # (drafts, truth)

    def propose(self, inputs) -> Drafts:
        tokens = []
        for seq in inputs.seqs:
            full = self.full[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            truth = full[seq.num_tokens : seq.num_tokens + seq.num_lookahead]
            draft = [
                t if (seq.num_tokens + j) % self.corrupt_every else (t + 1) % 1000
                for j, t in enumerate(truth)
            ]
            tokens.append(draft)
            self.proposed.append((draft, truth))
        return Drafts(tokens, [None] * len(inputs.seqs))

    def release(self, seq_id: int) -> None:
        pass


def expected_acceptance(proposed: list[tuple[list[int], list[int]]]) -> int:
    total = 0
    for draft, truth in proposed:
        for d, t in zip(draft, truth):
            if d != t:
                break
            total += 1
    return total


def test_accepts_exactly_the_correct_prefix_and_stops_inside_a_run(case):
    path, prompts, expected = case
    config = EngineConfig(block_size=4, num_gpu_blocks=200, speculative="ngram")
    stop_token = expected[1][9]  # the 10th token of prompt 1: inside an accepted run
    gen = GenerationConfig(NEW, ignore_eos=True, logprobs=2)
    with Engine.from_pretrained(path, EngineConfig(block_size=4, num_gpu_blocks=200)) as plain:
        reference = final_responses(submit_at_once(plain, prompts, gen))
        stopped = plain.create_instance().infer(
            0,
            prompts[1],
            gen_config=GenerationConfig(NEW, ignore_eos=True, stop_token_ids=[stop_token]),
        )
    with Engine.from_pretrained(path, config) as engine:
        oracle = OracleProposer(prompts, expected, corrupt_every=5)
        engine.call(lambda: setattr(engine.model_agent, "proposer", oracle))
        got = final_responses(submit_at_once(engine, prompts, gen))
        assert [r.token_ids for r in got] == expected
        for r, ref in zip(got, reference):  # logprobs of accepted drafts are the target's
            assert len(r.logprobs) == len(ref.logprobs) == NEW
            for mine, theirs in zip(r.logprobs, ref.logprobs):
                assert mine.keys() == theirs.keys()
                assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
        spec = engine.stats()["speculative"]
        assert spec["num_accepted_tokens"] == expected_acceptance(oracle.proposed) > 0
        assert spec["num_accepted_tokens"] < spec["num_draft_tokens"]
        r = engine.create_instance().infer(
            0,
            prompts[1],
            gen_config=GenerationConfig(NEW, ignore_eos=True, stop_token_ids=[stop_token]),
        )
        assert r.token_ids == stopped.token_ids and r.finish_reason == "stop"
        engine.check_integrity()


def test_prompt_lookup_finds_the_latest_match():
    lookup = NgramProposer(
        SpeculativeConfig("ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    ).lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # latest match of 1 2 3
    assert lookup([4, 5, 6, 4, 5], 4) == [6, 4, 5]  # runs up to the end
    assert lookup([4, 9, 8, 7, 5], 3) == []  # the last token never occurred before
    assert lookup([1, 2, 1, 2], 0) == []
    assert lookup([8, 1, 3, 8, 2, 8], 2) == [2, 8]  # 1-gram fallback, latest occurrence


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `counts` against `probs`; cells expected
    fewer than 5 times are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def test_rejection_sampling_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 60_000, 3, 6
    p_rows = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)  # [K+1, V]
    q_rows = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)  # [K, V]
    p = p_rows.expand(batch, k + 1, vocab)
    q = q_rows.expand(batch, k, vocab).clone()
    drafts = torch.stack(
        [torch.multinomial(q_rows[j], batch, True, generator=gen) for j in range(k)], 1
    )
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    q[torch.arange(k)[None, :].expand(batch, k) >= num_drafts[:, None]] = 0
    uniform = torch.rand(batch, k, generator=gen)
    noise = torch.empty(batch, vocab).exponential_(generator=gen)

    def emitted(num_accepted, next_token, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens emitted at `position` (rows that emitted one) and the row mask."""
        has = num_accepted >= position
        token = torch.where(num_accepted > position, drafts[:, min(position, k - 1)], next_token)
        return token[has], has

    num_accepted, next_token = rejection_sample(p, q, drafts, num_drafts, uniform, noise)
    assert ((num_accepted >= 0) & (num_accepted <= num_drafts)).all()
    for pos in range(k + 1):
        tokens, _ = emitted(num_accepted, next_token, pos)
        counts = torch.bincount(tokens, minlength=vocab)
        assert chi_square_p_value(counts, p_rows[pos]) > 1e-3, pos
    # negative control: accepting every draft gives the draft's distribution, and the same
    # test rejects it
    num_accepted, next_token = rejection_sample(p, q, drafts, num_drafts, uniform * 0, noise)
    tokens, _ = emitted(num_accepted, next_token, 0)
    assert chi_square_p_value(torch.bincount(tokens, minlength=vocab), p_rows[0]) < 1e-6


def test_sampled_tokens_keep_the_target_distribution(tiny_llama_path, drafts):
    """The first three sampled tokens of one prompt, 1,000 times with the near draft: their
    joint distribution equals the target's (computed with transformers), though about half
    of the drafts are rejected."""
    from transformers import AutoModelForCausalLM

    prompt, top_k, temperature, n = [11, 12, 13], 3, 6.0, 1000
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()

    def dist(ids: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1] / temperature
        values, idx = logits.topk(top_k)
        return dict(zip(idx.tolist(), values.softmax(-1).tolist()))

    joint: dict[tuple[int, ...], float] = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist(prompt + [a]).items():
            for c, pc in dist(prompt + [a, b]).items():
                joint[(a, b, c)] = pa * pb * pc
    config = EngineConfig(
        block_size=4, speculative=speculative("near", drafts, k=2), max_batch_size=128
    )
    gen = GenerationConfig(3, do_sample=True, temperature=temperature, top_k=top_k, ignore_eos=True)
    gens = [gen] * n
    torch.manual_seed(0)  # NOTE: unseeded requests draw from the global generator
    with Engine.from_pretrained(tiny_llama_path, config) as engine:
        got = final_responses(submit_at_once(engine, [prompt] * n, gens))
        spec = engine.stats()["speculative"]
        engine.check_integrity()
    assert 0.1 < spec["acceptance_rate"] < 0.95, spec  # both branches ran
    cells = sorted(joint)
    counts = torch.zeros(len(cells))
    for r in got:
        counts[cells.index(tuple(r.token_ids))] += 1
    p_value = chi_square_p_value(counts, torch.tensor([joint[c] for c in cells]))
    assert p_value > 1e-3, p_value


def test_bad_speculative_configs_are_refused(tiny_llama_path, drafts, smollm2_path, tmp_path):
    with pytest.raises(ValueError, match="method"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative={"method": "draft_model"})
    with pytest.raises(ValueError, match="unknown fields"):
        EngineConfig(speculative={"method": "ngram", "k": 3})
    assert EngineConfig(speculative="ngram", tp=2).speculative.method == "ngram"  # TP too
    assert (
        EngineConfig(speculative='{"num_speculative_tokens": 2}').speculative.num_speculative_tokens
        == 2
    )
    other = save_tiny_llama(tmp_path / "other", smollm2_path, vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine.from_pretrained(
            tiny_llama_path,
            EngineConfig(speculative={"method": "draft_model", "draft_model": other}),
        )


def test_speculative_flag_of_the_cli():
    from lmengine.cli import build_dataclass, build_parser

    args = build_parser().parse_args(
        ["generate", "hi", "--speculative", '{"method": "ngram", "num_speculative_tokens": 5}']
    )
    config = build_dataclass(EngineConfig, args)
    assert config.speculative == SpeculativeConfig("ngram", num_speculative_tokens=5)
