"""OpenAI presence and frequency penalties: the batched sampler against a per-token
reference written from OpenAI's formula, over generated tokens only."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lmengine import GenerationConfig
from lmengine.engine.sampling import Sampler, openai_penalties
from lmengine.scheduler import Sequence


def reference(logits: torch.Tensor, generated: list[int], presence: float, frequency: float):
    out = logits.clone()
    for token, count in Counter(generated).items():
        out[token] -= presence + frequency * count
    return out


def test_penalties_match_the_formula_row_by_row():
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab)
    generated = [[3, 3, 3, 9], [], [39, 0, 39], [5]]
    presence = [0.5, 1.0, -0.7, 2.0]
    frequency = [0.3, 2.0, 1.1, -2.0]
    got = openai_penalties(logits, generated, presence, frequency)
    for i in range(4):
        want = reference(logits[i], generated[i], presence[i], frequency[i])
        torch.testing.assert_close(got[i], want)


def test_sampler_penalises_generated_tokens_only_and_changes_greedy_choice():
    vocab = 10
    logits = torch.zeros(2, vocab)
    logits[:, 4] = 1.0  # the favourite, already generated twice
    logits[:, 6] = 0.8
    cfg = GenerationConfig(frequency_penalty=0.2)
    # prompt [4, 4, 6], generated [4, 4]: only the generated 4s count
    seqs = [
        Sequence(0, 0, [4, 4, 6, 4, 4], cfg, num_prompt_tokens=3),
        Sequence(1, 1, [4, 4, 6, 4, 4], GenerationConfig(), num_prompt_tokens=3),
    ]
    results = Sampler([], torch.device("cpu")).sample(logits, seqs)
    assert results[0].token_id == 6  # 1.0 - 2 * 0.2 = 0.6 < 0.8
    assert results[1].token_id == 4  # no penalty for the other row


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [-2.5, 2.5, "x"])
def test_penalty_range_is_validated(name, value):
    with pytest.raises(ValueError, match=name):
        GenerationConfig(**{name: value})


def test_request_fields_map_to_generation_config():
    from lmengine.serve.app import _gen_configs
    from lmengine.serve.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        stop="##",
        seed=3,
        presence_penalty=0.4,
        frequency_penalty=-0.3,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[5],
    )
    a, b = _gen_configs(body, 1, body.max_tokens, 4, session_len=100)
    assert (a.max_new_tokens, a.min_new_tokens, a.do_sample, a.temperature) == (7, 2, True, 0.5)
    assert (a.top_p, a.top_k, a.stop_words, a.stop_token_ids) == (0.9, 0, ["##"], [5])
    assert (a.presence_penalty, a.frequency_penalty, a.repetition_penalty) == (0.4, -0.3, 1.2)
    assert a.ignore_eos and a.logprobs == 4
    assert (a.random_seed, b.random_seed) == (3, 4)  # n choices draw differently
    greedy = _gen_configs(body.model_copy(update={"temperature": 0}), 1, 7, None, 100)[0]
    assert not greedy.do_sample
