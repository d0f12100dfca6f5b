"""Streaming an answer costs what the answer is long: each step the engine puts on a request's
queue only what is new (token ids, logprobs, text), never the answer so far, so the bytes of a
2,000-token stream grow linearly with its length; the front ends assemble the answer once."""

from __future__ import annotations

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.api import Pipeline
from lmengine.engine.request import Response, new_queue
from tests.conftest import save_tiny_llama

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    path = save_tiny_llama(
        tmp_path_factory.mktemp("long_llama"), smollm2_path, max_position_embeddings=8192
    )
    with Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=300, block_size=16)) as eng:
        yield eng


def _stream(engine: Engine, num_tokens: int) -> list[Response]:
    """Every Response the engine put on the queue of one greedy answer with logprobs."""
    cfg = GenerationConfig(max_new_tokens=num_tokens, ignore_eos=True, logprobs=1)
    wire = new_queue()
    Pipeline(engine)._add(PROMPT, cfg, wire, index=0)
    deltas = []
    while not deltas or deltas[-1].finish_reason is None:
        item = wire.get(timeout=300)
        deltas.extend(item if isinstance(item, list) else [item])
    return deltas


@pytest.mark.parametrize("num_tokens", [100, 2000])
def test_each_step_sends_only_what_is_new(engine, num_tokens):
    deltas = _stream(engine, num_tokens)
    assert deltas[-1].finish_reason == "length"
    # one delta per step, each with the one token that step generated and its logprobs
    assert len(deltas) == num_tokens
    assert all(len(d.token_ids) == 1 and len(d.logprobs) == 1 for d in deltas)
    assert [d.generate_token_len for d in deltas] == list(range(1, num_tokens + 1))
    # every character of the text travels once: the wire carries the answer's size in all
    whole = engine.create_instance().infer(
        1, PROMPT, gen_config=GenerationConfig(max_new_tokens=num_tokens, ignore_eos=True)
    )
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert sum(len(d.text) for d in deltas) == len(whole.text)


def test_instance_stream_assembles_every_token_so_far(engine):
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True, logprobs=1)
    seen = list(engine.create_instance().stream_infer(2, PROMPT, gen_config=cfg))
    assert [len(r.token_ids) for r in seen] == list(range(1, 13))
    assert [len(r.logprobs) for r in seen] == list(range(1, 13))
    final = seen[-1]
    assert all(r.token_ids == final.token_ids[: len(r.token_ids)] for r in seen)
    assert all(final.text.startswith(r.text) for r in seen)
