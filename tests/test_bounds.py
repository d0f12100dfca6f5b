"""State that grows with traffic stays bounded (docs/operations.md, "What is bounded"): the
interactive QoS sessions forget their least recently used idle ones, xgrammar's cache of
compiled grammars stays under its byte limit, and /metrics exports each server table's size
under one label set that requests cannot widen."""

from __future__ import annotations

import json
from collections import OrderedDict
from types import SimpleNamespace

from lmengine.serve import client as client_module
from lmengine.serve.client import ServerContext
from lmengine.serve.metrics import ServerMetrics
from lmengine.serve.responses import ResponseStore


def test_interactive_sessions_forget_the_least_recently_used_idle_ones(monkeypatch):
    monkeypatch.setattr(client_module, "MAX_INTERACTIVE_SESSIONS", 3)
    ctx = SimpleNamespace(sessions=OrderedDict())
    busy = {"messages": [], "job": object()}
    ServerContext.keep_session(ctx, 0, busy)  # a running turn: never forgotten
    for sid in range(1, 4):
        ServerContext.keep_session(ctx, sid, {"messages": [], "job": None})
    assert list(ctx.sessions) == [0, 2, 3]  # 1 was the least recently used idle one
    ServerContext.keep_session(ctx, 2, ctx.sessions[2])  # a new turn of 2
    for sid in range(10, 20):
        ServerContext.keep_session(ctx, sid, {"messages": [], "job": None})
    assert len(ctx.sessions) == 3 and 0 in ctx.sessions and list(ctx.sessions)[-1] == 19
    busy["job"] = None  # its turn ended: now it may go
    ServerContext.keep_session(ctx, 20, {"messages": [], "job": None})
    assert 0 not in ctx.sessions and list(ctx.sessions) == [18, 19, 20]


def test_stored_responses_keep_the_last_ones():
    store = ResponseStore(capacity=4)
    for i in range(10):
        store.put({"id": f"resp_{i}"}, [])
    assert list(store.entries) == [f"resp_{i}" for i in range(6, 10)]


def test_table_sizes_are_exported_under_fixed_labels():
    metrics = ServerMetrics()
    table: dict[int, int] = {}
    metrics.track("interactive_sessions", lambda: len(table))
    metrics.track("stored_responses", lambda: 7)
    table.update({1: 1, 2: 2})
    text = metrics.render({})
    assert 'lmengine_server_state_entries{state="interactive_sessions"} 2' in text
    assert 'lmengine_server_state_entries{state="stored_responses"} 7' in text
    for endpoint in ("chat_completions", "completions"):  # a finish reason per request: no
        for user in range(50):  # label takes a value from the request (user, model, adapter)
            metrics.count_request(endpoint, "stop")
            metrics.count_error(400 + user % 2)
    lines = [ln for ln in metrics.render({}).splitlines() if not ln.startswith("#")]
    assert len(lines) == len([ln for ln in text.splitlines() if not ln.startswith("#")]) + 4


def test_the_grammar_cache_stays_under_its_byte_limit(smollm2_path, monkeypatch):
    from transformers import AutoTokenizer

    from lmengine.engine import structured

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    eos = [tokenizer.eos_token_id]
    unbounded = structured.GrammarCompiler(tokenizer, len(tokenizer), eos)
    limit = 64 << 10
    monkeypatch.setattr(structured, "GRAMMAR_CACHE_BYTES", limit)
    bounded = structured.GrammarCompiler(tokenizer, len(tokenizer), eos)
    for i in range(40):  # a new schema every request, as a hostile client would send
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}}
        spec = {"json": json.dumps(schema)}
        unbounded.compile(spec)
        bounded.compile(spec)
    assert unbounded.cache_bytes() > 2 * limit, "the schemas are too small to test the bound"
    assert 0 < bounded.cache_bytes() <= limit * 1.25
