"""SmolLM2-135M-Instruct (the default model): 16 chat prompts x 48 greedy float32 tokens equal
transformers `generate`, in a batch, from staggered threads, with a pool small enough to force
preemption and a prefill budget small enough to chunk prompts."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.api import chat_token_ids
from tests.engine_utils import loop_held, run_threads
from tests.hf_reference import hf_greedy

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "examples" / "prompts.txt"
NUM_PROMPTS, NEW_TOKENS = 16, 48


@pytest.fixture(scope="module")
def smol_case(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    lines = PROMPTS_FILE.read_text().splitlines()[:NUM_PROMPTS]
    prompts = [chat_token_ids(tok, [{"role": "user", "content": p}]) for p in lines]
    expected = hf_greedy(smollm2_path, prompts, NEW_TOKENS)
    return smollm2_path, prompts, expected


CONFIGS = {
    "batch": dict(num_gpu_blocks=512),
    # about four sequences fit at a time: forces preemption and recompute
    "preempt_block1": dict(block_size=1, num_gpu_blocks=400),
    "chunked_block4": dict(block_size=4, num_gpu_blocks=800, max_prefill_token_num=32),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_smollm2_matches_transformers(smol_case, name):
    path, prompts, expected = smol_case
    engine = Engine.from_pretrained(path, EngineConfig(**CONFIGS[name]))
    try:
        preempt = name.startswith("preempt")  # then the first step must see every request
        got = run_threads(
            engine,
            prompts,
            GenerationConfig(max_new_tokens=NEW_TOKENS),
            stagger_s=0.0 if preempt else 0.02,
            together=preempt,
        )
        for i, (r, exp) in enumerate(zip(got, expected)):
            assert r.token_ids == exp, f"prompt {i} differs"
        if name.startswith("preempt"):
            assert engine.stats()["num_preemptions"] > 0
        engine.check_integrity()
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
    finally:
        engine.close()


@pytest.mark.slow
def test_smollm2_long_prompts_in_one_prefill_step(smollm2_path):
    """Three ~550-token prompts prefilled together in one step of 1,652 rows: the GEMMs take
    the large-batch path of `kernels.linear` (MKL on Intel, oneDNN elsewhere), decode the
    small. The loop is held until all three requests are queued, so they share the step."""
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    lines = PROMPTS_FILE.read_text().splitlines()
    prompts = []
    for start in (0, 21, 42):
        text = " ".join(lines[(start + i) % len(lines)] for i in range(60))
        prompts.append(chat_token_ids(tok, [{"role": "user", "content": text}]))
    assert sum(map(len, prompts)) == 1652, [len(p) for p in prompts]
    expected = hf_greedy(smollm2_path, prompts, 16)
    with Engine.from_pretrained(smollm2_path, EngineConfig(num_gpu_blocks=256)) as engine:
        steps = []  # (prefill rows, sequences) of every step
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            steps.append((out.num_prefill_tokens, len(out.scheduled)))
            return out

        engine.scheduler.schedule = recording_schedule
        results = [None] * len(prompts)

        def work(i):
            results[i] = engine.create_instance().infer(
                i, prompts[i], gen_config=GenerationConfig(max_new_tokens=16)
            )

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        with loop_held(engine, num_pending=len(prompts)):  # all three in the first step
            for t in threads:
                t.start()
        for t in threads:
            t.join(timeout=600)
        assert [r.token_ids for r in results] == expected
        assert steps[0] == (1652, 3), steps[:3]  # one prefill step of every prompt
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


@pytest.mark.slow
def test_smollm2_prompt_logprobs_and_hidden_states_equal_transformers(smol_case):
    """Scoring and reading SmolLM2 through the engine, batched, chunked and preempted."""
    import torch

    from tests.hf_reference import hf_forward

    path, prompts, expected = smol_case
    prompts = [p + e[:8] for p, e in zip(prompts[:8], expected)]  # longer, varied prompts
    cfg = GenerationConfig(
        max_new_tokens=4, prompt_logprobs=2, output_hidden_states=(15, 30), ignore_eos=True
    )
    config = EngineConfig(block_size=4, num_gpu_blocks=28, max_prefill_token_num=32)
    with Engine.from_pretrained(path, config) as engine:
        got = run_threads(engine, prompts, cfg, together=True)  # the pool must fill
        assert engine.stats()["num_preemptions"] > 0
    for prompt, r in zip(prompts, got):
        lp, hidden = hf_forward(path, prompt + r.token_ids)
        for i in range(1, len(prompt)):
            assert abs(r.prompt_logprobs[i][prompt[i]] - lp[i - 1, prompt[i]].item()) < 1e-4
        for layer in (15, 30):
            h = r.hidden_states[layer]
            assert h.shape[0] == len(prompt) + len(r.token_ids) - 1
            torch.testing.assert_close(h, hidden[layer][: h.shape[0]], rtol=1e-4, atol=1e-3)


@pytest.mark.slow
def test_smollm2_on_its_gguf_blocks_matches_transformers(smol_case):
    """quant_policy="gguf": the default model computes on its file's Q4_1 blocks (weight-only,
    float32 activations), which expand bit for bit to the float32 weights transformers runs:
    the same greedy tokens, batched from threads (GEMV rows and larger GEMMs alike)."""
    _, prompts, expected = smol_case
    engine = Engine.from_pretrained(None, EngineConfig(num_gpu_blocks=512, quant_policy="gguf"))
    try:
        kinds = {type(m).__name__ for m in engine.model_agent.runner.model.modules()}
        assert "GGUFLinear" in kinds
        got = run_threads(
            engine, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS), stagger_s=0.02
        )
        for i, (r, exp) in enumerate(zip(got, expected)):
            assert r.token_ids == exp, f"prompt {i} differs"
        engine.check_integrity()
    finally:
        engine.close()


def test_gguf_policy_needs_a_gguf_model(tiny_llama_path):
    with pytest.raises(ValueError, match="needs a model loaded from a .gguf file"):
        Engine.from_pretrained(tiny_llama_path, EngineConfig(quant_policy="gguf"))


def test_gguf_policy_with_tp_is_a_clear_error():
    with pytest.raises(ValueError, match="tp > 1 with quant_policy='gguf' is not supported"):
        Engine.from_pretrained(None, EngineConfig(quant_policy="gguf", tp=2, device="cpu"))
