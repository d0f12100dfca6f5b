"""Tensor parallelism over gloo on CPU: tp=2 equals tp=1 token for token (GQA, and fewer KV
heads than ranks, with preemption and several threads), shards hold ~1/N of the weights,
close() leaves no process, a dead or failing worker fails every request without a hang, and
bad settings are refused before any process starts."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.distributed.load import load_shard, weight_bytes
from tests.conftest import save_tiny_llama
from tests.engine_utils import random_prompts, run_threads

LENGTHS = [1, 5, 17, 33, 3, 40]
NEW = 12
# the longest sequence needs 13 blocks of 4: a pool of 24 holds fewer than two at once
PREEMPT = dict(block_size=4, num_gpu_blocks=24)


@pytest.fixture(scope="module")
def kv1_path(tmp_path_factory, smollm2_path) -> str:
    """4 query heads, 1 KV head: with tp=2 both ranks hold the same KV head. Also tied
    embeddings and random biases on every linear (colwise biases split per part, rowwise
    biases added once)."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(
        tmp_path_factory.mktemp("tiny_kv1"),
        smollm2_path,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))  # larger biases made outputs repetitive
    model.save_pretrained(path)
    return path


def _prompts(path: str) -> list[list[int]]:
    from transformers import AutoConfig

    return random_prompts(LENGTHS, AutoConfig.from_pretrained(path).vocab_size, seed=3)


def _run(
    path: str, tp: int, threads: int, prompts=None, stagger_s: float = 0.0, **cfg
) -> tuple[list, dict, Engine]:
    # NOTE: device="cpu": these tests are about gloo; on a GPU machine tp=2 would need 2 GPUs
    engine = Engine.from_pretrained(path, EngineConfig(tp=tp, device="cpu", **cfg))
    got = run_threads(
        engine,
        prompts or _prompts(path),
        GenerationConfig(max_new_tokens=NEW),
        num_threads=threads,
        stagger_s=stagger_s,
        together=True,  # the first step sees every thread's request: preemption by design
    )
    return [r.token_ids for r in got if r.finish_reason in ("stop", "length")], got, engine


def _assert_no_worker_left(procs) -> None:
    for proc in procs:
        proc.wait(timeout=10)  # raises if a worker is still running
    assert not dist.is_initialized()


def _check_equal_under_preemption(engine, got, responses, expected) -> None:
    assert [r.error for r in responses] == [None] * len(LENGTHS)
    assert got == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the small pool was meant to force preemption"
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    engine.check_integrity()


def test_tp2_equals_tp1_with_preemption_and_threads(tiny_llama_path):
    expected, _, ref = _run(tiny_llama_path, 1, threads=3, **PREEMPT)
    ref.close()
    got, responses, engine = _run(tiny_llama_path, 2, threads=3, **PREEMPT)
    procs = list(engine.model_agent.workers.procs.values())
    try:
        _check_equal_under_preemption(engine, got, responses, expected)
        # every rank holds about half of the weights (norms are replicated)
        per_rank = engine.call(engine.model_agent.rank_weight_bytes)
        full = sum(os.path.getsize(p) for p in _safetensors(tiny_llama_path))
        assert len(per_rank) == 2
        for b in per_rank:
            assert 0.45 * full < b < 0.55 * full, (per_rank, full)
    finally:
        engine.close()
    assert [p.returncode for p in procs] == [0]  # stopped by the engine, not killed
    _assert_no_worker_left(procs)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_with_speculative_decoding_equals_tp1(tiny_llama_path, method):
    """The same step code runs with and without TP, so speculative decoding (prompt lookup,
    or a draft model whole on rank 0) works with tp=2: greedy output equals tp=1 without
    speculation, under preemption and threads, and drafts were proposed and accepted."""
    # prompts that repeat themselves, so that prompt lookup finds drafts the model accepts
    prompts = [p * 2 for p in _prompts(tiny_llama_path)]  # at most 80 tokens
    # NOTE: all six at once (with three threads running two each, the long ones might not
    # overlap), queued in this order: whether the pool runs out depends on the order (of 24
    # orders tried, one never preempted), so thread t submits 0.1 s after thread t - 1
    prompts = [prompts[i] for i in (4, 3, 1, 0, 5, 2)]  # 6, 66, 10, 2, 80, 34 tokens
    expected, _, ref = _run(tiny_llama_path, 1, threads=6, prompts=prompts, **PREEMPT)
    ref.close()
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["draft_model"] = tiny_llama_path
    got, responses, engine = _run(
        tiny_llama_path, 2, threads=6, prompts=prompts, stagger_s=0.1, speculative=spec, **PREEMPT
    )
    procs = list(engine.model_agent.workers.procs.values())
    try:
        _check_equal_under_preemption(engine, got, responses, expected)
        spec = engine.stats()["speculative"]
        assert spec["num_accepted_tokens"] > 0, spec
        assert sum(r.num_accepted_tokens for r in responses) > 0
    finally:
        engine.close()
    _assert_no_worker_left(procs)


@pytest.mark.parametrize(
    "arch",
    [
        *("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "glm4", "granite"),
        *("qwen3_moe", "deepseek_v3"),
    ],
)
def test_tp2_equals_tp1_on_other_architectures(arch, tmp_path, smollm2_path):
    """The patches' TP plans beyond Llama: attention biases (Qwen2), per-head q/k norms
    (Qwen3), a sliding window (Mistral), soft-caps, alternating windows and four norms per
    layer (Gemma 2), local and global rotary bases (Gemma 3), q/k/v and gate/up fused in the
    checkpoint (Phi-3, GLM-4), multipliers (Granite), experts split over the ranks
    (Qwen3-MoE, DeepSeek-V3 with its shared experts and replicated latent attention). Tiny
    random models of the parity tests, several requests batched."""
    from tests.test_models_parity import save_tiny_model

    path = save_tiny_model(tmp_path / arch, smollm2_path, arch)
    expected, _, ref = _run(path, 1, threads=1, num_gpu_blocks=64)
    ref.close()
    got, responses, engine = _run(path, 2, threads=1, num_gpu_blocks=64)
    try:
        assert [r.error for r in responses] == [None] * len(LENGTHS)
        assert got == expected
        engine.check_integrity()
    finally:
        engine.close()


@pytest.mark.parametrize(
    "arch,message",
    [
        ("gpt_neox", "tp > 1 is not supported for this checkpoint.*Use tp=1"),
        ("olmo2", "OLMo 2's q/k norms span every head"),
        ("mixtral", "tensor 'model.layers.0.mlp.gate.weight' is not in it"),
        ("opt", "declares no tensor-parallel plan"),
        ("gpt_oss", "declares no tensor-parallel plan"),
    ],
)
def test_tp2_on_an_architecture_it_cannot_split_is_a_clear_error(
    arch, message, tmp_path, smollm2_path
):
    from tests.test_models_parity import save_tiny_model

    path = save_tiny_model(tmp_path / arch, smollm2_path, arch)
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(path, EngineConfig(tp=2, device="cpu", num_gpu_blocks=32))
    assert not dist.is_initialized()


def test_experts_are_split_over_the_ranks(tmp_path, smollm2_path):
    """Each rank holds half of the experts, read from the checkpoint's per-expert tensors,
    and the routers whole."""
    from tests.test_models_parity import save_tiny_model

    path = save_tiny_model(tmp_path / "qwen3_moe", smollm2_path, "qwen3_moe")
    full, _ = load_shard(path, "float32", torch.device("cpu"), 0, 1, False)
    full_moe = full.model.layers[1].mlp
    assert full_moe.experts.gate_up_proj.shape[0] == 8
    for rank in (0, 1):
        shard, _ = load_shard(path, "float32", torch.device("cpu"), rank, 2, False)
        moe = shard.model.layers[1].mlp
        assert moe.lmengine_expert_range == (4 * rank, 4 * rank + 4)
        rows = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(moe.experts.gate_up_proj, full_moe.experts.gate_up_proj[rows])
        assert torch.equal(moe.experts.down_proj, full_moe.experts.down_proj[rows])
        assert torch.equal(moe.gate.weight, full_moe.gate.weight)


def _safetensors(path: str) -> list[str]:
    return [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]


def test_shards_hold_their_slice_only(tiny_llama_path, kv1_path):
    """Per-rank shapes and bytes, without processes: each rank reads its slices only."""
    full, _ = load_shard(tiny_llama_path, "float32", torch.device("cpu"), 0, 1, False)
    shards = [
        load_shard(tiny_llama_path, "float32", torch.device("cpu"), r, 2, False)[0] for r in (0, 1)
    ]
    for shard in shards:
        attn = shard.model.layers[0].self_attn
        assert attn.qkv_proj.output_sizes == [2 * 16, 16, 16]  # 2 of 4 heads, 1 of 2 KV heads
        assert attn.o_proj.in_features == 32
        assert shard.model.layers[0].mlp.gate_up_proj.output_sizes == [64, 64]
        assert 0.45 < weight_bytes(shard) / weight_bytes(full) < 0.55
    # q rows of rank 1 are heads 2..3 of the full q projection, k rows KV head 1
    full_qkv = full.model.layers[0].self_attn.qkv_proj
    qkv1 = shards[1].model.layers[0].self_attn.qkv_proj
    q_full, k_full, _ = full_qkv.split(full_qkv.weight.T)  # [in, rows] per part
    q1, k1, _ = qkv1.split(qkv1.weight.T)
    assert torch.equal(q1, q_full[:, 32:]) and torch.equal(k1, k_full[:, 16:])
    # fewer KV heads than ranks: both ranks hold the one KV head
    kv1 = [load_shard(kv1_path, "float32", torch.device("cpu"), r, 2, False)[0] for r in (0, 1)]
    k = [m.model.layers[1].self_attn.qkv_proj.weight[32:48] for m in kv1]
    assert kv1[0].model.layers[1].self_attn.qkv_proj.output_sizes == [32, 16, 16]
    assert torch.equal(k[0], k[1])
    assert kv1[0].lm_head.weight is kv1[0].model.embed_tokens.weight  # still tied
    # biases: colwise ones split with their rows, rowwise ones on rank 0 only
    full1, _ = load_shard(kv1_path, "float32", torch.device("cpu"), 0, 1, False)
    full_attn, attn1 = full1.model.layers[0].self_attn, kv1[1].model.layers[0].self_attn
    q_b, k_b, v_b = full_attn.qkv_proj.split(full_attn.qkv_proj.bias)
    assert torch.equal(attn1.qkv_proj.bias, torch.cat([q_b[32:], k_b, v_b]))
    gate_b, up_b = full1.model.layers[0].mlp.gate_up_proj.split(
        full1.model.layers[0].mlp.gate_up_proj.bias
    )
    assert torch.equal(
        kv1[1].model.layers[0].mlp.gate_up_proj.bias, torch.cat([gate_b[64:], up_b[64:]])
    )
    assert torch.equal(kv1[0].model.layers[0].self_attn.o_proj.bias, full_attn.o_proj.bias)
    assert attn1.o_proj.bias is None


def test_vocab_shards_cover_the_vocabulary_once():
    from lmengine.distributed.shard import _vocab_range

    for vocab, tp in [(49152, 2), (49153, 2), (10, 4), (7, 8)]:
        ranges = [_vocab_range(vocab, r, tp) for r in range(tp)]
        rows = [i for start, stop, _ in ranges for i in range(start, stop)]
        assert rows == list(range(vocab))
        assert len({stop - start + pad for start, stop, pad in ranges}) == 1  # equal shards


def test_tp2_fewer_kv_heads_than_ranks_then_a_worker_dies(kv1_path):
    expected, _, ref = _run(kv1_path, 1, threads=2, **PREEMPT)
    ref.close()
    got, responses, engine = _run(kv1_path, 2, threads=2, **PREEMPT)
    procs = list(engine.model_agent.workers.procs.values())
    try:
        assert [r.error for r in responses] == [None] * len(LENGTHS)
        assert got == expected
        # kill the worker in the middle of a long generation: right after its first token,
        # since session_len is 96 here and a fixed sleep let the whole request finish first
        inst = engine.create_instance()
        result = {}
        started = threading.Event()
        gen = GenerationConfig(max_new_tokens=400, ignore_eos=True)

        def stream() -> None:
            for result["r"] in inst.stream_infer(1, [5, 6], gen_config=gen):
                started.set()

        runner = threading.Thread(target=stream)
        runner.start()
        assert started.wait(timeout=30), "the request never produced a token"
        os.kill(procs[0].pid, signal.SIGKILL)
        runner.join(timeout=30)
        assert not runner.is_alive(), "the request hung after its worker died"
        assert result["r"].finish_reason == "error"
        assert "worker rank 1 died" in result["r"].error
        late = inst.infer(2, [5, 6], gen_config=GenerationConfig(max_new_tokens=4))
        assert late.finish_reason == "error" and "died" in late.error
        deadline = time.monotonic() + 10
        while engine.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_alive, "the engine kept running without its worker"
    finally:
        engine.close()
    _assert_no_worker_left(procs)


def test_worker_that_fails_to_start(tiny_llama_path, monkeypatch):
    from lmengine.distributed import TPWorkerError

    monkeypatch.setenv("LMENGINE_TP_FAULT", "start:1")
    with pytest.raises(TPWorkerError, match="rank 1 failed: .*injected start failure"):
        Engine.from_pretrained(tiny_llama_path, EngineConfig(tp=2, device="cpu", num_gpu_blocks=8))
    assert not dist.is_initialized()


def test_bad_tp_settings_are_refused_before_start(tiny_llama_path, tmp_path):
    cases = [
        (dict(tp=3), "tp=3 does not divide num_attention_heads=4"),
        (dict(tp=8), "tp=8 does not divide num_attention_heads=4"),
        (dict(tp=2, quant_policy="w8a8"), "w8a8"),
    ]
    if (os.cpu_count() or 1) < 4:
        cases.append((dict(tp=4), "CPU cores"))
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            Engine.from_pretrained(tiny_llama_path, EngineConfig(device="cpu", **cfg))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    with pytest.raises(ValueError, match="from_pretrained"):
        Engine(model, None, EngineConfig(tp=2))


def test_step_channel_round_trip_and_growth():
    """The wire format and its protocol without processes: the broadcast is replaced by a
    list that the sender appends to and the receiver reads in order. Workers get the StepInput
    without its rank-0-only sampling fields."""
    from lmengine.distributed.step import StepChannel
    from lmengine.engine.step import SeqInput, StepInput
    from lmengine.scheduler.adapter_manager import AdapterLoad, AdapterPlan

    sender, receiver = StepChannel(torch.device("cpu"), 64), StepChannel(torch.device("cpu"), 64)
    wire: list[torch.Tensor] = []
    sender._broadcast = lambda: wire.append(sender.buffer.clone())
    receiver._broadcast = lambda: receiver.buffer.copy_(wire.pop(0))
    gen = GenerationConfig(max_new_tokens=3)
    big = StepInput(
        seqs=[
            SeqInput(
                1,
                0,
                list(range(299)),
                list(range(75)),
                True,
                2,
                gen_config=gen,
                token_ids=list(range(299)),
                num_prompt_tokens=299,
            ),
            SeqInput(2, 7, [5, 9, 9], [80, 81], False, None, num_lookahead=2, num_drafts=2),
        ],  # fmt: skip
        blocks_to_swap_in=[(1, 2)],
        blocks_to_swap_out=[(3, 4), (5, 6)],
        adapter_plan=AdapterPlan([AdapterLoad(2, {"qkv": [5, 6]})], {2: {"qkv": [5, 6]}}, [0]),
        finished_seq_ids=[4],
    )
    small = StepInput(blocks_to_copy=[(9, 10)])
    for inputs in (big, small, big):
        sender.send(inputs.for_workers())
        got = receiver.receive()
        assert not wire
        assert dataclasses.asdict(got) == dataclasses.asdict(inputs.for_workers())
        for mine, theirs in zip(inputs.seqs, got.seqs):
            assert (theirs.input_ids, theirs.block_table) == (mine.input_ids, mine.block_table)
            assert theirs.num_logits == mine.num_logits
            assert theirs.gen_config is None and theirs.token_ids == []
    assert big.seqs[0].gen_config is gen  # rank 0's own input keeps them
    assert receiver.buffer.numel() == sender.buffer.numel() > 64
    sender.send_control({"op": "store", "path": "/a/b é"})  # a LoRA control message
    assert receiver.receive() == {"op": "store", "path": "/a/b é"}
    sender.send(None)
    assert receiver.receive() is None


def test_tp2_research_hooks_equal_tp1(tiny_llama_path):
    """Prompt logprobs, hidden states, steering (its vectors travel to every rank) and a
    logits processor (rank 0) give with tp=2 what they give with tp=1, under preemption."""
    from lmengine.config import SteeringVector

    vector = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    asks = [
        dict(prompt_logprobs=2),
        dict(output_hidden_states="all"),
        dict(steering={1: SteeringVector(vector, start=3)}),
        dict(logits_processors=[lambda ids, row: row.index_fill_(0, torch.arange(100), -1e9)]),
    ]
    prompts = _prompts(tiny_llama_path)
    configs = [
        GenerationConfig(max_new_tokens=NEW, **asks[i % len(asks)]) for i in range(len(prompts))
    ]
    results = {}
    for tp in (1, 2):
        engine = Engine.from_pretrained(
            tiny_llama_path, EngineConfig(tp=tp, device="cpu", **PREEMPT)
        )
        try:
            # together: the first step sees every thread's request (preemption by design)
            results[tp] = run_threads(engine, prompts, configs, num_threads=3, together=True)
            if tp == 2:
                assert engine.stats()["num_preemptions"] > 0
                engine.check_integrity()
        finally:
            engine.close()
    for one, two in zip(results[1], results[2]):
        assert two.error is None and two.token_ids == one.token_ids
        if one.prompt_logprobs is not None:
            for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
                assert a.keys() == b.keys()
                assert max(abs(a[t] - b[t]) for t in a) < 1e-4
        if one.hidden_states is not None:
            for layer, h in one.hidden_states.items():
                torch.testing.assert_close(two.hidden_states[layer], h, rtol=1e-4, atol=1e-4)
