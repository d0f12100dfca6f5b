"""The last layer on the logits rows alone (models/context.py's `kept_rows`): a Llama-shaped
model writes every row's K and V in its last layer, then runs that layer's attention queries,
output projection and MLP on the rows whose logits the step reads; the other layers, the
steps whose rows are all read (decodes) run every row, and a step that reads none (prompt
chunks short of their ends) stops its last layer once K and V are cached. The tokens and
log-probabilities are those of every row run, within float32 rounding, over prompts alone,
prompt chunks beside decodes, a long prompt's chunks alone and speculative decoding (several
rows read per sequence)."""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.models import llama
from tests.engine_utils import random_prompts, run_threads

GEN = GenerationConfig(max_new_tokens=6, logprobs=2, ignore_eos=True)


def generate(path, cfg: EngineConfig, prompts, gen=GEN):
    with Engine.from_pretrained(path, cfg) as engine:
        out = run_threads(engine, prompts, gen, together=True)
        engine.check_integrity()
    return [(r.token_ids, r.logprobs) for r in out]


def test_the_last_layer_runs_on_the_logits_rows_alone(monkeypatch, tiny_llama_path):
    """Each MLP call's rows, per layer: the first layer sees every row of a step, the last
    one the rows that get logits; a prompt chunk short of its end calls no MLP there."""
    calls: list[tuple[int, int]] = []
    real = llama.PatchedLlamaMLP.forward

    def recording(self, x):
        calls.append((self.layer_index, x.shape[0]))
        return real(self, x)

    monkeypatch.setattr(llama.PatchedLlamaMLP, "forward", recording)
    monkeypatch.setenv("LMENGINE_DECODE_LOOP", "0")  # the modules run (the loop's twin of
    # this layer gives the same bits: tests/test_decode_loop.py)
    cfg = EngineConfig(dtype="float32", num_gpu_blocks=64, max_prefill_token_num=16)
    with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
        layers = engine.model_agent.runner.model.model.layers
        for i, layer in enumerate(layers):
            layer.mlp.layer_index = i
        last = len(layers) - 1
        run_threads(engine, random_prompts([5, 9, 2], 49152, seed=1), GEN, together=True)
        assert by_step(calls)[0] == [(0, 16), *[(i, 16) for i in range(1, last)], (last, 3)]
        run_threads(engine, random_prompts([40], 49152, seed=2), GEN)
        engine.check_integrity()
    steps = by_step(calls)
    # the 40-token prompt in chunks of 16, 16 and 8: only its last chunk is read
    chunks = [s for s in steps if s[0][1] > 1][-3:]
    assert [s[0][1] for s in chunks] == [16, 16, 8]
    assert [s[-1] for s in chunks] == [(last - 1, 16), (last - 1, 16), (last, 1)]
    decodes = [s for s in steps if s[0][1] <= 3]
    assert decodes and all(s[-1] == (last, s[0][1]) for s in decodes)  # every row


def by_step(calls: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(layer, rows) calls cut into steps, each starting at layer 0."""
    steps: list[list[tuple[int, int]]] = []
    for layer, rows in calls:
        if layer == 0:
            steps.append([])
        steps[-1].append((layer, rows))
    return steps


@pytest.mark.parametrize(
    "schedule",
    [
        {},  # prompts in one step, then decodes
        {"max_prefill_token_num": 12},  # prompt chunks beside decodes
        {"speculative": "ngram"},  # a decode step reads every drafted row
    ],
)
def test_the_kept_rows_give_every_rows_tokens(monkeypatch, tiny_llama_path, schedule):
    prompts = random_prompts([7, 30, 3, 18], 49152, seed=3)
    prompts.append([5, 6, 7, 8] * 6)  # repeats: the n-gram drafter proposes tokens
    cfg = EngineConfig(dtype="float32", num_gpu_blocks=256, **schedule)
    kept = generate(tiny_llama_path, cfg, prompts)
    monkeypatch.setattr(llama, "_kept_rows", lambda layer, ctx: None)
    assert_same_tokens(kept, generate(tiny_llama_path, cfg, prompts))


def assert_same_tokens(kept, whole) -> None:
    """The same tokens, and log-probabilities within float32 rounding."""
    assert len(kept) == len(whole)
    for (tokens, logprobs), (tokens_whole, logprobs_whole) in zip(kept, whole):
        assert tokens == tokens_whole
        for step, step_whole in zip(logprobs, logprobs_whole, strict=True):
            assert step.keys() == step_whole.keys()
            for token, value in step.items():
                assert value == pytest.approx(step_whole[token], abs=1e-4)


def test_chunks_that_read_no_row_give_every_rows_tokens(monkeypatch, tiny_llama_path):
    """A long prompt alone, in chunks of 8: the chunks before its last read no row and stop
    their last layer after its K and V, which the later chunks and the decodes attend to."""
    prompts = random_prompts([45], 49152, seed=4)
    for loop in ("0", "1"):  # the modules, then the compiled layer loop where it is built
        monkeypatch.setenv("LMENGINE_DECODE_LOOP", loop)
        cfg = EngineConfig(dtype="float32", num_gpu_blocks=64, max_prefill_token_num=8)
        kept = generate(tiny_llama_path, cfg, prompts)
        with monkeypatch.context() as patch:
            patch.setattr(llama, "_kept_rows", lambda layer, ctx: None)
            assert_same_tokens(kept, generate(tiny_llama_path, cfg, prompts))


def test_not_kept_when_research_hooks_read_the_layers(monkeypatch, tiny_llama_path):
    """Hidden states read from the last layer: every row runs it."""
    from lmengine.models.context import StepContext

    asked: list[bool] = []
    real = llama._kept_rows

    def watched(layer, ctx: StepContext):
        out = real(layer, ctx)
        asked.append(out is not None)
        return out

    monkeypatch.setattr(llama, "_kept_rows", watched)
    cfg = EngineConfig(dtype="float32", num_gpu_blocks=64)
    with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
        num_layers = len(engine.model_agent.runner.model.model.layers)
        gen = GenerationConfig(max_new_tokens=2, output_hidden_states=(num_layers,))
        out = engine.create_instance().infer(1, list(range(3, 12)), gen_config=gen)
        assert out.hidden_states[num_layers].shape[0] == 9 + 1  # every prompt row, then one
        assert asked and not any(asked)
        engine.create_instance().infer(2, list(range(3, 12)), gen_config=GEN)
        assert any(asked)  # the same prompt without hooks keeps its logits rows
    assert torch.is_tensor(out.hidden_states[num_layers])
