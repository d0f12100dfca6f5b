"""The streaming helper every endpoint shares, driven by a scripted job: per-choice deltas,
the error event of a failed choice, the usage chunk and `data: [DONE]`; a stream that ends
early or times out cancels its job, in SSE and in NDJSON framing."""

from __future__ import annotations

import asyncio
import json

from lmengine.engine.request import Response
from lmengine.serve.errors import APIError
from lmengine.serve.streaming import NDJSON, SSE, ChunkShape, _guarded, stream_choices


class ScriptedJob:
    """A Job's surface for streaming: its choices and a fixed list of (index, Response)."""

    def __init__(self, num_choices: int, items: list[tuple[int, Response]]) -> None:
        self.choices = [None] * num_choices
        self.items = items
        self.cancelled: list[str] = []
        self.is_done = False

    async def responses(self):
        for item in self.items:
            yield item

    def cancel(self, reason: str) -> None:
        self.cancelled.append(reason)


async def collect(events) -> list[str]:
    return [event async for event in events]


def sse_payloads(events: list[str]) -> list:
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events), events
    return [e[len("data: ") : -2] for e in events]


def test_stream_choices_deltas_error_event_usage_and_done():
    job = ScriptedJob(
        2,
        [
            (0, Response(text="He", token_ids=[1])),
            (1, Response(text="Yo", token_ids=[7])),
            (0, Response(text="llo", token_ids=[2], finish_reason="length")),
            (1, Response(text="", token_ids=[], finish_reason="error", error="boom")),
        ],
    )
    shape = ChunkShape("cmpl-1", "text_completion", "m", created=5)
    calls = []

    def make_chunk(i, resp):
        calls.append((i, resp.text, resp.token_ids))
        return shape.chunk(i, text=resp.text, finish_reason=resp.finish_reason)

    opening = [shape.chunk(0, text="<echo>")]
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    events = asyncio.run(collect(stream_choices(job, shape, opening, make_chunk, lambda: usage)))
    *chunks, done = sse_payloads(events)
    assert done == "[DONE]"
    chunks = [json.loads(c) for c in chunks]
    # make_chunk gets the engine's deltas as they are; a failed choice gets the error event
    assert calls == [(0, "He", [1]), (1, "Yo", [7]), (0, "llo", [2])]
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks[:4]]
    assert texts == [(0, "<echo>"), (0, "He"), (1, "Yo"), (0, "llo")]
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert chunks[4]["error"]["message"] == "boom" and chunks[4]["error"]["type"] == "server_error"
    assert chunks[5] == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [],
        "usage": usage,
    }
    assert len(chunks) == 6


def test_stream_choices_skips_empty_chunks_and_usage_when_not_asked():
    job = ScriptedJob(1, [(0, Response(text="", token_ids=[])), (0, Response(text="a"))])
    shape = ChunkShape("c", "chat.completion.chunk", "m")

    def make_chunk(i, resp):
        return shape.chunk(i, delta={"content": resp.text}) if resp.text else None

    events = asyncio.run(collect(stream_choices(job, shape, [], make_chunk, None)))
    payloads = sse_payloads(events)
    assert payloads[-1] == "[DONE]" and len(payloads) == 2
    assert json.loads(payloads[0])["choices"][0]["delta"] == {"content": "a"}


def test_guarded_turns_a_timeout_into_a_last_event_and_cancels():
    async def timing_out():
        yield SSE.event({"n": 1})
        raise APIError(504, "request timed out", "timeout", "timeout")

    for framing, tail in ((SSE, ["data: [DONE]\n\n"]), (NDJSON, [])):
        job = ScriptedJob(1, [])
        events = asyncio.run(collect(_guarded(job, timing_out(), framing)))
        error = framing.event(APIError(504, "request timed out", "timeout", "timeout").body())
        assert events == [SSE.event({"n": 1}), error, *tail]
        assert job.cancelled == ["client disconnected"]  # NOTE: the job had not finished


def test_guarded_closed_early_cancels_the_job_and_closes_the_events():
    closed = []

    async def endless():
        try:
            while True:
                yield "x"
        finally:
            closed.append(True)

    async def read_one(job):
        stream = _guarded(job, endless(), SSE)
        first = await anext(stream)
        await stream.aclose()  # what the server does when the client hangs up
        return first

    job = ScriptedJob(1, [])
    assert asyncio.run(read_one(job)) == "x"
    assert job.cancelled == ["client disconnected"] and closed == [True]
    done = ScriptedJob(1, [])
    done.is_done = True
    asyncio.run(read_one(done))
    assert done.cancelled == []  # a finished job is left alone


def test_tokens_without_text_are_still_chunks(tiny_llama_path, tmp_path):
    """A model whose every token is a special one (skipped from the text): the stream has one
    chunk per token all the same (with empty text, as vLLM sends them), so a client's first
    chunk never waits for visible text."""
    import torch
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmengine import Engine, EngineConfig
    from lmengine.serve.app import ServerSettings, build_app

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # equal logits: greedy takes token 0, a special token
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(tmp_path)
    engine = Engine.from_pretrained(str(tmp_path), EngineConfig(num_gpu_blocks=64))
    body = {"model": "tiny", "max_tokens": 4, "ignore_eos": True, "stream": True, "temperature": 0}
    with TestClient(build_app(engine, ServerSettings(model_name="tiny"))) as http:
        with http.stream("POST", "/v1/completions", json={**body, "prompt": "Hi"}) as r:
            events = [line for line in r.iter_lines() if line]
        *chunks, done = [
            json.loads(e[len("data: ") :]) if e != "data: [DONE]" else e for e in events
        ]
        assert done == "data: [DONE]"
        assert [c["choices"][0]["text"] for c in chunks] == ["", "", "", ""]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]

        chat = {**body, "messages": [{"role": "user", "content": "Hi"}]}
        with http.stream("POST", "/v1/chat/completions", json=chat) as r:
            events = [line for line in r.iter_lines() if line]
        deltas = [json.loads(e[len("data: ") :])["choices"][0]["delta"] for e in events[:-1]]
        assert deltas == [{"role": "assistant", "content": ""}] + [{"content": ""}] * 4
