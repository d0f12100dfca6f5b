"""S-LoRA with tensor parallelism over gloo on CPU: a tp=2 engine serving several adapters of
different ranks and targets plus the base model in one batch, with more adapters than the
pool holds (paging while running), equals tp=1 and peft token for token (greedy float32);
adapters added and removed at run time reach the worker; each rank holds its shard of the
adapter only. One tp=2 engine serves every case (a spawn costs seconds)."""

from __future__ import annotations

import pytest
import torch

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.api import Pipeline
from tests.engine_utils import random_prompts
from tests.test_lora import ADAPTERS, MAX_NEW, peft_greedy, save_adapter

CPU = torch.device("cpu")
GEN = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
NAMES = ["qv4", "all8rs", None, "ko16", "all8rs", "qv4", None, "ko16", "ko16", "all8rs"]
LENGTHS = [5, 9, 3, 12, 7, 4, 8, 6, 11, 2]
# one slot of rank 16: the three adapters cannot be resident together, so they are evicted and
# loaded again while the batch runs (page loads travel with the step broadcast)
CFG = dict(max_lora_slots=1, num_gpu_blocks=64, block_size=4, device="cpu")


@pytest.fixture(scope="module")
def tp_adapter_paths(tiny_llama_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_adapters")
    paths = {
        name: save_adapter(tiny_llama_path, root / name, seed=i, **args)
        for i, (name, args) in enumerate(ADAPTERS.items())
    }
    late = dict(r=8, lora_alpha=8, target_modules=["q_proj", "o_proj", "gate_proj", "down_proj"])
    paths["late"] = save_adapter(tiny_llama_path, root / "late", seed=7, **late)
    return paths


@pytest.fixture(scope="module")
def tp2_engine(tiny_llama_path):
    """No adapter at build: the first `add_adapter` enables the pool on every rank."""
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(tp=2, **CFG))
    yield engine
    engine.close()


def _prompts(engine: Engine) -> list[list[int]]:
    return random_prompts(LENGTHS, engine.info.vocab_size, seed=3)


def test_tp2_mixed_adapter_batch_equals_tp1_and_peft(tiny_llama_path, tp_adapter_paths, tp2_engine):
    prompts = _prompts(tp2_engine)
    expected = peft_greedy(tiny_llama_path, tp_adapter_paths, prompts, NAMES)
    adapters = {k: v for k, v in tp_adapter_paths.items() if k != "late"}
    with Engine.from_pretrained(tiny_llama_path, EngineConfig(adapters=adapters, **CFG)) as ref:
        tp1 = [o.token_ids for o in Pipeline(ref)(prompts, gen_config=GEN, adapter_name=NAMES)]
    assert tp1 == expected
    for name in ADAPTERS:  # the first one enables the pool (max_lora_rank 16) on every rank
        if name not in tp2_engine.adapter_names:
            tp2_engine.add_adapter(name, tp_adapter_paths[name])
    got = Pipeline(tp2_engine)(prompts, gen_config=GEN, adapter_name=NAMES)
    assert [o.error for o in got] == [None] * len(prompts)
    assert [o.token_ids for o in got] == expected
    stats = tp2_engine.stats()
    assert stats["num_adapter_evictions"] > 0 and stats["num_adapter_loads"] > 3
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    tp2_engine.check_integrity()


def test_tp2_adapter_shards(tp2_engine, tp_adapter_paths, smollm2_path, tmp_path):
    """Rank 0's pool: B split with the output rows of q/k/v, A with the input columns of o;
    with one KV head, both ranks keep all of k's and v's B rows."""
    from lmengine.distributed.load import load_shard
    from lmengine.distributed.lora import TPLoRAPool
    from lmengine.engine.lora_pool import read_peft_adapter
    from tests.conftest import save_tiny_llama

    pool = tp2_engine.model_agent.lora
    whole = read_peft_adapter(tp_adapter_paths["all8rs"], pool.full_targets, torch.float32)
    shard = pool.read(tp_adapter_paths["all8rs"])
    q, k, _ = shard.parts["self_attn.qkv_proj"][0]
    q_full, k_full, _ = whole.parts["self_attn.qkv_proj"][0]
    assert torch.equal(q.lora_a, q_full.lora_a) and torch.equal(q.lora_b, q_full.lora_b[:32])
    assert torch.equal(k.lora_b, k_full.lora_b[:16])  # 1 of 2 KV heads of 16
    (o,) = shard.parts["self_attn.o_proj"][1]
    (o_full,) = whole.parts["self_attn.o_proj"][1]
    assert torch.equal(o.lora_a, o_full.lora_a[:, :32]) and torch.equal(o.lora_b, o_full.lora_b)

    # fewer KV heads than ranks (shards built in this process, no group needed)
    kv1 = save_tiny_llama(tmp_path / "kv1", smollm2_path, num_key_value_heads=1)
    path = save_adapter(kv1, tmp_path / "kv1_lora", seed=3, **ADAPTERS["all8rs"])
    pools = [TPLoRAPool(load_shard(kv1, "float32", CPU, r, 2, False)[0], CPU) for r in (0, 1)]
    whole = read_peft_adapter(path, pools[0].full_targets, torch.float32)
    shards = [pool.read(path) for pool in pools]
    q_full, k_full, v_full = whole.parts["self_attn.qkv_proj"][1]
    for rank, shard in enumerate(shards):
        q, k, v = shard.parts["self_attn.qkv_proj"][1]
        assert torch.equal(q.lora_b, q_full.lora_b[32 * rank : 32 * (rank + 1)])
        assert torch.equal(k.lora_b, k_full.lora_b) and torch.equal(v.lora_b, v_full.lora_b)
        (down,) = shard.parts["mlp.down_proj"][0]
        (down_full,) = whole.parts["mlp.down_proj"][0]
        assert torch.equal(down.lora_a, down_full.lora_a[:, 64 * rank : 64 * (rank + 1)])


def test_tp2_add_and_remove_at_run_time(tiny_llama_path, tp_adapter_paths, tp2_engine):
    engine = tp2_engine
    inst = engine.create_instance()
    prompt = random_prompts([6], engine.info.vocab_size, seed=5)[0]
    r = inst.infer(1, prompt, gen_config=GEN, adapter_name="late")
    assert r.finish_reason == "error" and "unknown adapter" in r.error
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_adapter("bad", tiny_llama_path)  # a model folder, not an adapter
    engine.add_adapter("late", tp_adapter_paths["late"])
    (expected,) = peft_greedy(tiny_llama_path, tp_adapter_paths, [prompt], ["late"])
    (base,) = peft_greedy(tiny_llama_path, tp_adapter_paths, [prompt], [None])
    assert expected != base
    long_gen = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    stream = inst.stream_infer(2, prompt, gen_config=long_gen, adapter_name="late")
    first = next(stream)
    engine.remove_adapter("late")  # the running request finishes with its adapter
    rest = list(stream)
    assert first.token_ids[:1] == expected[:1] and rest[-1].token_ids == expected
    r = inst.infer(3, prompt, gen_config=GEN, adapter_name="late")
    assert r.finish_reason == "error" and "unknown adapter" in r.error
    engine.add_adapter("again", tp_adapter_paths["late"])
    assert inst.infer(4, prompt, gen_config=GEN, adapter_name="again").token_ids == expected
    assert inst.infer(5, prompt, gen_config=GEN).token_ids == base
    engine.check_integrity()
    assert engine.is_alive
