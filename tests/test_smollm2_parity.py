"""SmolLM2-135M-Instruct (the default model): 16 chat prompts x 48 greedy float32 tokens equal
transformers `generate`, in a batch, from staggered threads, with a pool small enough to force
preemption and a prefill budget small enough to chunk prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.api import chat_token_ids
from tests.engine_utils import run_threads
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
        got = run_threads(
            engine, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS), stagger_s=0.02
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
    """Three ~600-token prompts prefilled in one 1,800-row step: the GEMMs take the
    large-batch path of `kernels.linear` (MKL on Intel, oneDNN elsewhere), decode the small."""
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    lines = PROMPTS_FILE.read_text().splitlines()
    prompts = []
    for start in (0, 21, 42):
        text = " ".join(lines[(start + i) % len(lines)] for i in range(60))
        prompts.append(chat_token_ids(tok, [{"role": "user", "content": text}]))
    assert sum(map(len, prompts)) > 1100, [len(p) for p in prompts]
    expected = hf_greedy(smollm2_path, prompts, 16)
    with Engine.from_pretrained(smollm2_path, EngineConfig(num_gpu_blocks=256)) as engine:
        got = run_threads(engine, prompts, GenerationConfig(max_new_tokens=16))
        assert [r.token_ids for r in got] == expected
        assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
