"""Beam search against transformers `generate(num_beams=k)` (float32, token for token, every
returned sequence), batched with normal requests, under preemption, and without block leaks."""

from __future__ import annotations

import random
import threading
import time

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.cli import build_dataclass, build_parser
from tests.engine_utils import run_threads
from tests.hf_reference import hf_beam, hf_greedy


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(rng.randrange(3, 10))]


def _frequent_token(path: str, ids: list[int], cfg: GenerationConfig) -> int:
    """A token the beams produce early, to use as an extra end token: hypotheses then end
    at different lengths, which exercises the finished-hypotheses logic."""
    seqs, _ = hf_beam(path, ids, cfg)
    return seqs[0][3]


def _check(engine, path, ids, cfg, session_id=0):
    ref, ref_scores = hf_beam(path, ids, cfg)
    out = engine.create_instance().infer(session_id, ids, gen_config=cfg)
    assert out.error is None
    assert out.beam_token_ids == ref, (cfg, ids)
    assert out.token_ids == ref[0]
    # float32 sums in a different order: an ulp or two apart, and with length_penalty=-1 a
    # score is the sum times the length (hundreds), so the tolerance is relative as well
    assert out.beam_scores == pytest.approx(ref_scores, rel=1e-6, abs=1e-4)
    assert out.finish_reason == ("stop" if len(ref[0]) < cfg.max_new_tokens else "length") or (
        out.finish_reason == "stop" and ref[0][-1] in (cfg.stop_token_ids or [])
    )
    return out


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    cfg = EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=256)
    with Engine.from_pretrained(tiny_llama_path, cfg) as eng:
        yield eng


CASES = [
    dict(num_beams=2, max_new_tokens=8),
    dict(num_beams=4, max_new_tokens=10, length_penalty=0.5),
    dict(num_beams=3, max_new_tokens=9, early_stopping=True, num_return_sequences=3),
    dict(num_beams=3, max_new_tokens=9, early_stopping="never", length_penalty=2.0),
    dict(num_beams=2, max_new_tokens=8, repetition_penalty=1.5, no_repeat_ngram_size=2),
    dict(num_beams=3, max_new_tokens=1, num_return_sequences=3),  # done in the prompt's round
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_beam_matches_transformers(engine, tiny_llama_path, case):
    rng = random.Random(case)
    cfg = GenerationConfig(**CASES[case])
    _check(engine, tiny_llama_path, _prompt(rng), cfg, session_id=case)
    engine.check_integrity()


@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(early_stopping=True),
        dict(early_stopping="never", length_penalty=-1.0),
        dict(min_new_tokens=4, length_penalty=0.0),  # the end token is banned where it came
        dict(ignore_eos=True, length_penalty=0.0, num_beams=4),
        dict(ignore_eos=True, length_penalty=1.5),  # long beams win: nothing ends early
    ],
)
def test_beam_with_end_tokens_matches_transformers(engine, tiny_llama_path, extra):
    """Hypotheses that end early (an end token among the candidates), every stopping rule."""
    rng = random.Random(7)
    ids = _prompt(rng)
    base = dict(num_beams=3, max_new_tokens=10, num_return_sequences=3)
    stop = _frequent_token(tiny_llama_path, ids, GenerationConfig(**base))
    cfg = GenerationConfig(**{**base, **extra}, stop_token_ids=[stop])
    out = _check(engine, tiny_llama_path, ids, cfg, session_id=100)
    ended = [t[-1] == stop for t in out.beam_token_ids]
    if "min_new_tokens" in extra:
        assert all(len(t) >= 4 for t in out.beam_token_ids)
    else:
        assert any(ended) == (extra.get("length_penalty") != 1.5), ended
    engine.check_integrity()


def _beams_and_greedy(rng):
    """Six long prompts: three beam requests (k = 3, 2, 4) alternating with greedy ones.
    Returns (prompts, configs, the greedy config)."""
    prompts = [_prompt(rng) + _prompt(rng) for _ in range(6)]
    beams = [
        GenerationConfig(num_beams=3, max_new_tokens=10, num_return_sequences=2),
        GenerationConfig(num_beams=2, max_new_tokens=12, length_penalty=0.7),
        GenerationConfig(num_beams=4, max_new_tokens=8, early_stopping=True),
    ]
    greedy = GenerationConfig(max_new_tokens=12)
    return prompts, [beams[0], greedy, beams[1], greedy, beams[2], greedy], greedy


def _small_pool(eviction_type, **extra):
    """A 24-block pool of 4-token blocks: too small for the mix above to run at once."""
    return EngineConfig(
        dtype="float32",
        block_size=4,
        num_gpu_blocks=24,
        num_cpu_blocks=64 if eviction_type == "swap" else 0,
        eviction_type=eviction_type,
        **extra,
    )


@pytest.mark.parametrize(
    "eviction_type,prefix_caching", [("recompute", False), ("swap", False), ("recompute", True)]
)
def test_beam_batched_with_greedy_under_preemption(tiny_llama_path, eviction_type, prefix_caching):
    """Beam requests and greedy requests together in a pool too small for all: beams are
    preempted (by recompute or swap) and forked; every output still equals transformers."""
    prompts, configs, greedy = _beams_and_greedy(random.Random(3))
    cfg = _small_pool(eviction_type, enable_prefix_caching=prefix_caching)
    with Engine.from_pretrained(tiny_llama_path, cfg) as eng:
        outs = run_threads(eng, prompts, configs, together=True)
        stats = eng.stats()
        eng.check_integrity()
        forks = stats["num_forks"]
    assert stats["num_preemptions"] > 0
    if eviction_type == "swap":
        assert stats["num_swap_outs"] > 0
    assert forks > 0
    greedy_ref = hf_greedy(tiny_llama_path, [prompts[i] for i in (1, 3, 5)], 12)
    for i, out in enumerate(outs):
        assert out.error is None
        if configs[i] is greedy:
            assert out.token_ids == greedy_ref[i // 2]
        else:
            ref, _ = hf_beam(tiny_llama_path, prompts[i], configs[i])
            assert out.beam_token_ids == ref, i


@pytest.mark.parametrize("eviction_type", ["recompute", "swap"])
def test_beams_never_stall_whatever_the_arrival_order(tiny_llama_path, eviction_type):
    """The same mix arriving in 8 random interleavings. Parked beams (row in, group waiting)
    once held the whole pool while their groups' other beams queued behind them: the engine
    then stepped on with nothing to run, forever (about 1 interleaving in 20). Every run
    must finish, with the same outputs."""
    rng = random.Random(4)
    prompts, configs, _ = _beams_and_greedy(rng)
    cfg = _small_pool(eviction_type)
    first = None
    with Engine.from_pretrained(tiny_llama_path, cfg) as eng:
        for run in range(8):
            delays = [rng.random() * 0.01 for _ in prompts]
            results = [None] * len(prompts)
            start = threading.Barrier(len(prompts))

            def work(i, delays=delays, results=results, start=start, run=run):
                start.wait()
                time.sleep(delays[i])
                session = 100 * run + i
                results[i] = eng.create_instance().infer(session, prompts[i], gen_config=configs[i])

            threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(6)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            assert all(r is not None for r in results), f"run {run} stalled: {eng.stats()}"
            got = [(r.token_ids, r.beam_token_ids) for r in results]
            first = first or got
            assert got == first, run
            eng.check_integrity()
        assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]


def test_beam_cancel_errors_and_no_leaks(tiny_llama_path):
    cfg = EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=40)
    with Engine.from_pretrained(tiny_llama_path, cfg) as eng:
        inst = eng.create_instance()
        # more blocks than the pool could ever give the group: a clear error, engine lives
        big = GenerationConfig(num_beams=8, max_new_tokens=40)
        out = inst.infer(1, [5, 6, 7], gen_config=big)
        assert out.finish_reason == "error" and "num_beams=8" in out.error
        wide = GenerationConfig(num_beams=eng.engine_config.max_batch_size + 1, max_new_tokens=1)
        out = inst.infer(1, [5, 6, 7], gen_config=wide)
        assert out.finish_reason == "error" and "max_batch_size" in out.error
        # cancelled mid-way: its beams are freed
        long = GenerationConfig(num_beams=3, max_new_tokens=30, ignore_eos=True)
        results = []
        t = threading.Thread(target=lambda: results.append(inst.infer(2, [9] * 5, gen_config=long)))
        t.start()
        time.sleep(0.3)
        inst.cancel(2)
        t.join(timeout=60)
        assert results and results[0].finish_reason in ("cancel", "length")
        eng.check_integrity()
        assert eng.stats()["num_free_blocks"] == 40
        # a beam request after all that still works
        ok = inst.infer(3, [4, 5, 6, 7], gen_config=GenerationConfig(num_beams=2, max_new_tokens=5))
        assert ok.finish_reason in ("stop", "length") and ok.token_ids
        eng.check_integrity()
        assert eng.call(lambda: dict(eng.requests)) == {}


def test_beam_config_validation():
    with pytest.raises(ValueError, match="num_beams must be >= 1, got 0"):
        GenerationConfig(num_beams=0)
    with pytest.raises(ValueError, match="num_return_sequences \\(3\\) must be <= num_beams"):
        GenerationConfig(num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
        GenerationConfig(num_beams=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="do_sample=True"):
        GenerationConfig(num_beams=2, do_sample=True)
    with pytest.raises(ValueError, match="stop_words"):
        GenerationConfig(num_beams=2, stop_words=["x"])
    assert GenerationConfig(num_beams=2, early_stopping="never").early_stopping == "never"
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--num-beams",
            "3",
            "--early-stopping",
            "true",
            "--length-penalty",
            "0.5",
        ]
    )
    gen = build_dataclass(GenerationConfig, args)
    assert (gen.num_beams, gen.early_stopping, gen.length_penalty) == (3, True, 0.5)


def test_beam_smollm2_matches_transformers(smollm2_path):
    from lmengine.api import pipeline

    cfg = GenerationConfig(num_beams=3, max_new_tokens=8, num_return_sequences=2)
    with pipeline(smollm2_path, EngineConfig(dtype="float32", num_gpu_blocks=64)) as pipe:
        ids = pipe.encode("What is the capital of France?")
        out = pipe(ids, gen_config=cfg)
        ref, _ = hf_beam(smollm2_path, ids, cfg)
        assert out.beam_token_ids == ref
        assert out.text == pipe.tokenizer.decode(ref[0], skip_special_tokens=True)
        assert out.beam_texts[1] == pipe.tokenizer.decode(ref[1], skip_special_tokens=True)
        deltas = list(pipe.stream_infer([ids], gen_config=cfg))
        assert len(deltas) == 1 and deltas[0].token_ids == ref[0]
        pipe.engine.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    """Scheduler-level, no model: after the prompt's round the k beams hold the prompt's full
    blocks by reference, each its own copy of the partial last block (emitted as
    blocks_to_copy of the next step), and freeing them all leaves the pool whole."""
    import torch

    from lmengine.engine.beam import BeamSearch
    from lmengine.scheduler import BlockManager, Scheduler, Sequence, get_policy

    sched = Scheduler(BlockManager(32, 0, 4), get_policy("fcfs"), 8, 64)
    cfg = GenerationConfig(num_beams=3, max_new_tokens=5)
    seq = Sequence(0, 0, list(range(10, 20)), cfg)  # 10 tokens: 2 full blocks + 2 tokens
    beams = BeamSearch(sched, [2], iter(range(1, 100)))
    sched.add_sequence(seq)
    group = beams.new_group(seq)
    out = sched.schedule()
    sched.update(out, {})
    row = torch.full((50,), -10.0)
    row[[30, 31, 32]] = torch.tensor([-0.1, -0.2, -0.3])  # three continuations of beam 0
    assert beams.advance({seq.seq_id: row}, [group]) == []
    assert [s.token_ids[-1] for s in group.beams] == [30, 31, 32]
    assert group.beams[0] is seq  # the first child continues in place
    shared = seq.block_table[:2]
    assert all(sched.block_manager.device.ref_counts[b] == 3 for b in shared)
    partials = [s.block_table[2] for s in group.beams]
    assert len(set(partials)) == 3
    sched.check_integrity()
    out = sched.schedule()
    assert sorted(out.blocks_to_copy) == sorted((seq.block_table[2], b) for b in partials[1:])
    assert [it.start_pos for it in out.scheduled] == [10, 10, 10]
    for beam in group.beams:
        sched.remove_sequence(beam)
    sched.check_integrity()
    assert sched.block_manager.num_free_blocks == 32


def test_generate_command_with_beams(tiny_llama_path, tmp_path):
    from tests.test_cli import run_cli

    out = tmp_path / "out.jsonl"
    res = run_cli(
        "generate", "a prompt", "--model", tiny_llama_path, "--num-gpu-blocks", "64",
        "--max-new-tokens", "5", "--num-beams", "3", "--num-return-sequences", "2",
        "--early-stopping", "never", "--jsonl", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (record,) = [__import__("json").loads(line) for line in out.read_text().splitlines()]
    assert len(record["beams"]) == 2 and record["beams"][0]["token_ids"] == record["token_ids"]
    assert record["beams"][0]["score"] >= record["beams"][1]["score"]


@pytest.mark.slow
def test_beam_with_tensor_parallelism(tiny_llama_path):
    """tp=2: the fork copies reach every rank through the step's blocks_to_copy."""
    cfg = GenerationConfig(num_beams=3, max_new_tokens=8, num_return_sequences=2)
    ids = [17, 410, 93, 1200, 7, 8]
    engine_cfg = EngineConfig(tp=2, device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64)
    with Engine.from_pretrained(tiny_llama_path, engine_cfg) as eng:
        out = eng.create_instance().infer(1, ids, gen_config=cfg)
        eng.check_integrity()
    assert out.beam_token_ids == hf_beam(tiny_llama_path, ids, cfg)[0]


def test_beam_refused_with_speculative_decoding(tiny_llama_path):
    cfg = EngineConfig(dtype="float32", block_size=4, num_gpu_blocks=64, speculative="ngram")
    with Engine.from_pretrained(tiny_llama_path, cfg) as eng:
        inst = eng.create_instance()
        out = inst.infer(1, [5, 6, 7], gen_config=GenerationConfig(num_beams=2, max_new_tokens=4))
        assert out.finish_reason == "error" and "speculative" in out.error
        assert inst.infer(2, [5, 6, 7], gen_config=GenerationConfig(max_new_tokens=4)).token_ids
        eng.check_integrity()
