"""Int8 KV cache end to end (EngineConfig.kv_cache_dtype="int8").

What it must keep: the same greedy choices as the float32 cache except at near ties, perplexity
within 1 % of float32 KV (SmolLM2 on the held-out text), swap and prefix caching moving the
scales with their blocks, tensor parallelism, and about 2x (fp16) / 3.8x (fp32) the blocks in
the same memory.

The greedy criterion, honestly: quantizing K and V moves the logits a little (max |error| about
0.15 on the tiny random models, whose logits have a std of ~1.3), so a token whose float32 top-2
margin is smaller than that may flip, and free-running generation then diverges for good. The
test is therefore teacher-forced: on the float32 cache's greedy continuations, the int8 cache
must pick the same token at >= 90 % of positions, and every disagreement must be a near tie
(float32 top-2 margin < 0.1).
"""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.cli import build_dataclass, build_parser
from lmengine.engine import cache_engine as ce
from lmengine.engine.cache_engine import CacheSpec, derive_num_blocks
from lmengine.engine.step import SeqInput, StepInput
from lmengine.models.context import step_context
from lmengine.quant.eval import heldout_token_ids, perplexity
from tests.engine_utils import random_prompts, run_threads
from tests.test_models_parity import save_tiny_model
from tests.test_prefix_cache_engine import shared_prefix_prompts
from tests.test_swap import SwapRecorder, final_responses, submit_at_once

PROMPT_LENGTHS = [5, 17, 33, 2, 60, 12, 40, 9]
NEW = 16


def test_config_and_flags():
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    for command in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", "int8"])
        assert build_dataclass(EngineConfig, args).kv_cache_dtype == "int8"


def test_block_bytes_count_the_scales(monkeypatch):
    def spec(dtype, kv):
        return CacheSpec(30, 3, 64, 16, dtype, kv)

    int8 = spec(torch.float32, "int8")
    assert int8.block_bytes == 2 * 30 * 16 * 3 * (64 + 4)  # int8 values + a float32 scale
    assert spec(torch.float16, "auto").block_bytes / int8.block_bytes == pytest.approx(1.88, 0.01)
    assert spec(torch.float32, "auto").block_bytes / int8.block_bytes == pytest.approx(3.76, 0.01)
    monkeypatch.setattr(ce, "free_memory_bytes", lambda device, in_use=(): 1 << 30)
    cpu = torch.device("cpu")
    fp32, q8 = (derive_num_blocks(spec(torch.float32, kv), cpu, 0.5) for kv in ("auto", "int8"))
    assert q8 == (1 << 29) // int8.block_bytes and 3.7 < q8 / fp32 < 3.8


def test_cache_engine_moves_scales_with_their_blocks():
    spec = CacheSpec(2, 2, 8, 4, torch.float32, "int8")
    cache = ce.CacheEngine(spec, num_gpu_blocks=6, num_cpu_blocks=3, device=torch.device("cpu"))
    for layer in cache.kv_caches:
        assert [tuple(t.shape) for t in layer] == [(6, 4, 2, 8)] * 2 + [(6, 4, 2)] * 2
        for t in layer:
            t.copy_(torch.randint(-127, 128, t.shape).to(t.dtype))
    before = [[t.clone() for t in layer] for layer in cache.kv_caches]
    cache.swap_out([(1, 0), (4, 2)])
    cache.copy([(1, 5)])
    cache.swap_in([(2, 0), (0, 3)])  # device 0 <- old block 4, device 3 <- old block 1
    for layer, old in zip(cache.kv_caches, before):
        for t, t0 in zip(layer, old):
            assert torch.equal(t[[0, 3, 5]], t0[[4, 1, 1]]) and torch.equal(t[2], t0[2])


def _all_logits(engine: Engine, seqs: list[list[int]]) -> torch.Tensor:
    """Teacher-forced logits of every position of every sequence, one packed prefill through
    the engine's cache (blocks 0.. of an idle engine, as lmengine.quant.eval does)."""

    def run() -> torch.Tensor:
        agent, items, first = engine.model_agent, [], 0
        block_size = agent.cache_engine.spec.block_size
        for i, s in enumerate(seqs):
            n = -(-len(s) // block_size)
            items.append(SeqInput(i, 0, s, list(range(first, first + n)), True))
            first += n
        ids, ctx = agent.runner.prepare(StepInput(items))
        ctx.logits_indices = torch.arange(ids.shape[0])
        with torch.inference_mode(), step_context(ctx):
            return agent.model(ids).float()  # [num_tokens, vocab]

    return engine.call(run, timeout=None)


@pytest.fixture(scope="module")
def tiny_models(tiny_llama_path, tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("kv_int8_models")
    paths = {"llama": tiny_llama_path}
    # sliding window; window + soft cap; local and global layers on their own rotary bases
    for name in ("mistral", "gemma2", "gemma3"):
        paths[name] = save_tiny_model(root / name, smollm2_path, name)
    return paths


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gemma3"])
def test_greedy_choices_equal_float32_kv_but_near_ties(tiny_models, name):
    path = str(tiny_models[name])
    prompts = random_prompts(PROMPT_LENGTHS, 49152, seed=1)
    cfg = dict(block_size=4, num_gpu_blocks=200)
    with Engine.from_pretrained(path, EngineConfig(**cfg)) as engine:
        outs = [r.token_ids for r in run_threads(engine, prompts, GenerationConfig(NEW))]
        seqs = [p + o for p, o in zip(prompts, outs)]
        ref = _all_logits(engine, seqs)
    with Engine.from_pretrained(path, EngineConfig(kv_cache_dtype="int8", **cfg)) as engine:
        got = _all_logits(engine, seqs)
        free_run = [r.token_ids for r in run_threads(engine, prompts, GenerationConfig(NEW))]
        engine.check_integrity()
    rows, starts = [], torch.cumsum(torch.tensor([0] + [len(s) for s in seqs]), 0)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        rows += range(int(starts[b]) + len(p) - 1, int(starts[b]) + len(p) - 1 + len(o))
    targets = torch.tensor([t for o in outs for t in o])
    ref, got = ref[rows], got[rows]
    assert torch.equal(ref.argmax(-1), targets)  # the float32 logits reproduce the run
    differ = got.argmax(-1) != targets
    margins = ref.topk(2, -1).values.diff(dim=-1).neg().squeeze(-1)  # top1 - top2
    assert float(differ.float().mean()) <= 0.10, f"{int(differ.sum())} of {len(targets)}"
    assert bool((margins[differ] < 0.1).all()), margins[differ]
    assert float((got - ref).abs().max()) < 0.3
    # free-running: sequences agree up to their first flip, and most agree to the end
    assert sum(a == b for a, b in zip(free_run, outs)) >= 2


def test_swap_and_prefix_caching_with_int8(tiny_llama_path):
    """Preemption by swap with prefix caching on an int8 cache: every swapped-in block is
    bit-identical to what was swapped out (int8 pages and scales), the outputs equal an int8
    engine that never preempts nor caches, and nothing leaks."""
    prompts = shared_prefix_prompts()
    gen = GenerationConfig(max_new_tokens=12)
    big = EngineConfig(kv_cache_dtype="int8", block_size=4, num_gpu_blocks=400)
    with Engine.from_pretrained(tiny_llama_path, big) as engine:
        expected = [r.token_ids for r in final_responses(submit_at_once(engine, prompts, gen))]
    cfg = EngineConfig(
        kv_cache_dtype="int8",
        block_size=4,
        num_gpu_blocks=30,
        num_cpu_blocks=12,
        eviction_type="swap",
        enable_prefix_caching=True,
    )
    with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
        cache = engine.model_agent.cache_engine
        layer = cache.kv_caches[0]
        assert [t.dtype for t in layer] == [torch.int8] * 2 + [torch.float32] * 2
        assert [t.dtype for t in cache.host_caches[0]] == [t.dtype for t in layer]
        recorder = SwapRecorder(cache)
        got = final_responses(submit_at_once(engine, prompts, gen))
        assert [r.token_ids for r in got] == expected
        engine.check_integrity()
        stats = engine.stats()
    assert stats["num_swap_outs"] > 0 and recorder.num_checked > 0 and not recorder.mismatches
    assert stats["num_prefix_cached_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_tp2_int8_equals_tp1_int8(tiny_llama_path):
    prompts = random_prompts([1, 5, 17, 33], 49152, seed=3)
    outs = {}
    for tp in (1, 2):
        cfg = EngineConfig(tp=tp, device="cpu", kv_cache_dtype="int8", block_size=4)
        with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
            outs[tp] = [r.token_ids for r in run_threads(engine, prompts, GenerationConfig(8))]
            engine.check_integrity()
    assert outs[2] == outs[1]


def test_smollm2_perplexity_within_1_percent_of_float32_kv(smollm2_path):
    """4 windows of 128 held-out tokens (the README's number uses 8: benchmarks/kv_int8.py)."""
    ppl = {}
    for kv in ("auto", "int8"):
        cfg = EngineConfig(kv_cache_dtype=kv, num_gpu_blocks=40)
        with Engine.from_pretrained(smollm2_path, cfg) as engine:
            ppl[kv] = perplexity(engine, heldout_token_ids(engine.tokenizer), 128, 4)
    assert ppl["int8"] != ppl["auto"]  # the int8 cache is really used
    assert abs(ppl["int8"] / ppl["auto"] - 1) < 0.01, ppl


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculative_decoding_on_an_int8_cache(tiny_llama_path, speculative):
    """Verification reads the drafted tokens' int8 KV like decoding does: greedy output equals
    the same int8 engine without speculation (the draft model, here the model itself, gets an
    int8 cache too)."""
    prompts = random_prompts([7, 20], 2000, seed=4)
    prompts += [[7, 8, 9] * 6, [100, 200] * 9]  # repetitive: prompt lookup finds n-grams
    spec = "ngram" if speculative == "ngram" else {"method": "draft_model"}
    if speculative == "draft":
        spec["draft_model"] = tiny_llama_path
    outs = {}
    for name, extra in (("plain", {}), ("spec", {"speculative": spec})):
        cfg = EngineConfig(kv_cache_dtype="int8", block_size=4, num_gpu_blocks=100, **extra)
        with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
            gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
            outs[name] = [r.token_ids for r in run_threads(engine, prompts, gen)]
            engine.check_integrity()
            if name == "spec":
                assert engine.stats()["speculative"]["num_accepted_tokens"] > 0
            if speculative == "draft" and name == "spec":
                draft_cache = engine.model_agent.proposer.cache_engine.kv_caches[0]
                assert draft_cache[0].dtype == torch.int8 and len(draft_cache) == 4
    assert outs["spec"] == outs["plain"]
