"""The compiled layer loop (models/decode_loop.py): a step runs every layer in one native call
and gives bit-identical log-probabilities to the modules' forward, in float32 and bfloat16 at
every row count (each linear on the route the modules take: GEMV, MKL's or oneDNN's packed
GEMM), at prompt steps and steps mixing prompt chunks with decodes (where the compiled prefill
kernel is built), and at decode steps on GGUF blocks; steps and models it does not serve (more
rows than the GGUF GEMV takes, LoRA, research hooks, an int8 cache, forward hooks, a replaced
weight) run the modules or a rebuilt loop, and stay exact."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.kernels import cpu_ext
from lmengine.kernels.linear import can_pack
from lmengine.models import llama
from tests.engine_utils import random_prompts, run_threads
from tests.test_gguf_models import write_llama_gguf

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason="needs the compiled CPU kernels")

GEN = GenerationConfig(max_new_tokens=8, logprobs=2)


@pytest.fixture
def loop_calls(monkeypatch):
    """How many forwards took the loop (a list of their row counts)."""
    rows: list[int] = []
    real = llama.run_decode_layers

    def counted(layers, hidden_states, ctx, owner, classes, kept=None):
        out = real(layers, hidden_states, ctx, owner, classes, kept)
        if out is not None:
            rows.append(hidden_states.shape[0])
        return out

    monkeypatch.setattr(llama, "run_decode_layers", counted)
    return rows


def generate(path, cfg: EngineConfig, prompts, gen=GEN):
    """(token ids, logprobs) of every prompt, all submitted before the first step."""
    with Engine.from_pretrained(path, cfg) as engine:
        out = run_threads(engine, prompts, gen, together=True)
        engine.check_integrity()
    return [(r.token_ids, r.logprobs) for r in out]


def with_and_without_loop(monkeypatch, path, cfg, prompts):
    monkeypatch.setenv("LMENGINE_DECODE_LOOP", "0")
    modules = generate(path, cfg, prompts)
    monkeypatch.setenv("LMENGINE_DECODE_LOOP", "1")
    return modules, generate(path, cfg, prompts)


@pytest.mark.parametrize(
    "dtype, batch, looped",
    [
        ("float32", 1, True),
        ("float32", 5, True),  # the float32 GEMV serves up to 8 rows (24 without AVX-512)
        ("float32", 12, True),
        ("float32", 40, True),  # MKL's packed GEMM (Intel) or oneDNN's
        ("bfloat16", 1, True),
        ("bfloat16", 3, True),
        ("bfloat16", 5, True),  # 4+ rows: oneDNN's tiles
        ("bfloat16", 40, True),
    ],
)
def test_the_loop_gives_the_modules_logprobs(
    monkeypatch, loop_calls, tiny_llama_path, dtype, batch, looped
):
    if dtype == "bfloat16" and not can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)):
        pytest.skip("oneDNN computes no bfloat16 on this CPU: nothing is packed")
    prompts = random_prompts(([3, 17, 9, 30, 5] * 8)[:batch], 49152, seed=batch)
    cfg = EngineConfig(dtype=dtype, block_size=4, num_gpu_blocks=512)
    modules, looped_out = with_and_without_loop(monkeypatch, tiny_llama_path, cfg, prompts)
    assert looped_out == modules  # token ids and every logprob, bit for bit
    assert bool(loop_calls) == looped
    if looped:
        assert batch in loop_calls  # the decode steps of the whole batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_chunks_beside_decodes_take_the_loop(
    monkeypatch, loop_calls, tiny_llama_path, dtype
):
    """A small prompt budget cuts prompts into chunks that share steps with running decodes
    (fresh prompts, cached chunks and decodes in one step): where the compiled prefill kernel
    is built, those steps take the loop too, and every logprob is the modules'."""
    from lmengine.kernels.paged_attention import prefill_kernel

    if not prefill_kernel(getattr(torch, dtype)):
        pytest.skip("the compiled prefill kernel is not built here (AVX-512, bfloat16 units)")
    prompts = random_prompts([3, 40, 9, 70, 5, 23], 49152, seed=11)
    cfg = EngineConfig(dtype=dtype, block_size=4, num_gpu_blocks=256, max_prefill_token_num=24)
    monkeypatch.setenv("LMENGINE_DECODE_LOOP", "0")
    modules = []
    for p in prompts:  # one at a time, then all together: both schedules
        modules += generate(tiny_llama_path, cfg, [p])
    modules += generate(tiny_llama_path, cfg, prompts)
    monkeypatch.setenv("LMENGINE_DECODE_LOOP", "1")
    looped = []
    for p in prompts:
        looped += generate(tiny_llama_path, cfg, [p])
    looped += generate(tiny_llama_path, cfg, prompts)
    assert looped == modules
    assert max(loop_calls) > len(prompts)  # steps with prompt chunks took it


def test_large_bfloat16_prompt_steps_take_the_loop_on_padded_rows(
    monkeypatch, loop_calls, tiny_llama_path
):
    """A bfloat16 step of 1,024+ rows runs its linears on rows padded to a multiple of 64
    (kernels/linear.py's `padded_rows`) in the loop as in the modules: the same logprobs, and
    the step's rows (not the pad) come back."""
    from lmengine.kernels.paged_attention import prefill_kernel

    if not prefill_kernel(torch.bfloat16) or not can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)):
        pytest.skip("the compiled bfloat16 prefill kernel or oneDNN bfloat16 is not here")
    prompts = random_prompts([600, 431, 30], 49152, seed=5)  # 1,061 rows, padded to 1,088
    cfg = EngineConfig(dtype="bfloat16", num_gpu_blocks=256, max_prefill_token_num=2048)
    modules, looped = with_and_without_loop(monkeypatch, tiny_llama_path, cfg, prompts)
    assert looped == modules
    assert max(loop_calls) == 1061


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_the_loop_on_gguf_blocks(monkeypatch, loop_calls, tmp_path, smollm2_path, qtype):
    from tests.conftest import save_tiny_llama

    hf = save_tiny_llama(tmp_path / "hf", smollm2_path, seed=3, tie_word_embeddings=True)
    parts = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    qtypes = {"token_embd": Q.Q8_0, **{part: qtype for part in parts}}
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, qtypes)
    prompts = random_prompts([4, 11], 49152, seed=1)
    cfg = EngineConfig(quant_policy="gguf", block_size=4, num_gpu_blocks=64)
    modules, looped_out = with_and_without_loop(monkeypatch, path, cfg, prompts)
    assert looped_out == modules
    assert loop_calls and max(loop_calls) == 2


def test_not_taken_with_an_int8_cache_or_research_hooks(monkeypatch, loop_calls, tiny_llama_path):
    prompts = random_prompts([5, 8], 49152, seed=2)
    int8 = EngineConfig(dtype="float32", kv_cache_dtype="int8", num_gpu_blocks=64)
    generate(tiny_llama_path, int8, prompts)
    hidden = GenerationConfig(max_new_tokens=4, output_hidden_states=[1])
    generate(tiny_llama_path, EngineConfig(dtype="float32"), prompts, gen=hidden)
    assert loop_calls == []


def test_forward_hooks_and_replaced_weights_are_seen(monkeypatch, loop_calls, tiny_llama_path):
    """A forward hook registered after the loop was built runs (the modules take the step); a
    weight replaced afterwards is what the rebuilt loop computes with."""
    prompt = random_prompts([6], 49152, seed=4)
    cfg = EngineConfig(dtype="float32", num_gpu_blocks=64)
    with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
        inst = engine.create_instance()
        model = engine.model_agent.runner.model
        first = inst.infer(1, prompt[0], gen_config=GEN)
        assert loop_calls  # built and used
        loop_calls.clear()
        seen = []
        handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.append(1))
        assert inst.infer(2, prompt[0], gen_config=GEN).logprobs == first.logprobs
        handle.remove()
        assert seen and not loop_calls  # every step ran the modules while the hook was there
        # a hook on the last layer sees every row: that layer then runs on all of them
        rows = []
        last = model.model.layers[-1].mlp
        handle = last.register_forward_hook(lambda m, a, o: rows.append(o.shape[0]))
        inst.infer(5, prompt[0], gen_config=GEN)
        handle.remove()
        assert rows[0] == len(prompt[0]) and not loop_calls

        down = model.model.layers[0].mlp.down_proj
        down.weight = torch.nn.Parameter(down.weight * 0.5, requires_grad=False)
        down.repack()
        changed = inst.infer(3, prompt[0], gen_config=GEN)
        assert loop_calls  # the loop was rebuilt with the new weight
        monkeypatch.setenv("LMENGINE_DECODE_LOOP", "0")
        assert inst.infer(4, prompt[0], gen_config=GEN).logprobs == changed.logprobs
        assert changed.logprobs != first.logprobs
        engine.check_integrity()


def test_lora_steps_run_the_modules(monkeypatch, loop_calls, tiny_llama_path, adapter_paths):
    name, folder = next(iter(adapter_paths.items()))
    cfg = EngineConfig(dtype="float32", adapters={name: folder}, num_gpu_blocks=64)
    prompts = random_prompts([5, 7], 49152, seed=6)
    generate(tiny_llama_path, cfg, prompts)
    assert loop_calls == []  # the linears are LoRA linears now
