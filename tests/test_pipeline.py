"""The pipeline on the default model: strings, chat messages, streaming deltas, context manager."""

from __future__ import annotations

import pytest

from lmengine import EngineConfig, GenerationConfig, Response, pipeline


@pytest.fixture(scope="module")
def pipe(smollm2_path):
    with pipeline(smollm2_path, engine_config=EngineConfig(num_gpu_blocks=256)) as p:
        yield p
    assert not p.engine.is_alive


def test_strings_and_chat_messages(pipe):
    outs = pipe(
        [
            "What is the capital of France?",
            [{"role": "user", "content": "What is the capital of France?"}],
        ],
        gen_config=GenerationConfig(max_new_tokens=24),
    )
    assert len(outs) == 2 and all(isinstance(o, Response) for o in outs)
    assert "Paris" in outs[0].text
    assert outs[0].text == outs[1].text  # a string is one user turn of the chat template
    assert [o.index for o in outs] == [0, 1]
    single = pipe("What is the capital of France?", gen_config=GenerationConfig(max_new_tokens=24))
    assert isinstance(single, Response) and single.text == outs[0].text


def test_stream_deltas_join_to_the_final_text(pipe):
    prompts = ["Write a haiku about the sea.", "Name three colors."]
    gen = GenerationConfig(max_new_tokens=32)
    finals = pipe(prompts, gen_config=gen)
    texts, tokens, reasons = ["", ""], [[], []], [None, None]
    for d in pipe.stream_infer(prompts, gen_config=gen):
        texts[d.index] += d.text
        tokens[d.index] += d.token_ids
        if d.finish_reason:
            reasons[d.index] = d.finish_reason
    assert texts == [f.text for f in finals]
    assert tokens == [f.token_ids for f in finals]
    assert reasons == [f.finish_reason for f in finals]


def test_raw_strings_without_template(pipe):
    from lmengine.api import Pipeline

    raw = Pipeline(pipe.engine, apply_chat_template=False)
    assert raw.encode("hello world") == list(pipe.tokenizer("hello world")["input_ids"])


def test_bad_prompt_is_an_error_response(pipe):
    outs = pipe(["fine", 42], gen_config=GenerationConfig(max_new_tokens=4))
    assert outs[0].finish_reason in ("stop", "length")
    assert outs[1].finish_reason == "error" and "prompt must be" in outs[1].error
