"""W8A8 quality on SmolLM2-135M-Instruct: perplexity on the committed held-out paragraphs
(never calibration text) within 3 % of float32 with SmoothQuant, worse without smoothing, and
chat answers still right. Calibration is kept tiny (4 x 64 tokens) for test time; the
benchmark (benchmarks/w8a8.py) uses the CLI defaults."""

from __future__ import annotations

import pytest

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.engine.loader import load_model_and_tokenizer
from lmengine.quant.eval import heldout_token_ids, perplexity
from lmengine.quant.w8a8 import calibrate, quantize_checkpoint

WINDOW, NUM_WINDOWS = 128, 8
_ENGINE = dict(num_gpu_blocks=NUM_WINDOWS * WINDOW // 16 + 8)


@pytest.fixture(scope="module")
def smol_results(smollm2_path, tmp_path_factory):
    """Perplexities (float32, SmoothQuant, plain W8A8) and the SmoothQuant checkpoint path."""
    model, tokenizer, _, _ = load_model_and_tokenizer(smollm2_path, "float32", "cpu")
    maxima = calibrate(model, tokenizer, 4, 64, show_progress=False)
    del model
    root = tmp_path_factory.mktemp("smol_w8a8")
    paths = {
        "float32": smollm2_path,
        "smoothquant": quantize_checkpoint(
            smollm2_path, root / "sq", alpha=0.5, act_maxima=maxima, show_progress=False
        ),
        "w8a8_no_smoothing": quantize_checkpoint(
            smollm2_path, root / "plain", alpha=None, show_progress=False
        ),
    }
    ppl = {}
    for name, path in paths.items():
        with Engine.from_pretrained(str(path), EngineConfig(**_ENGINE)) as engine:
            ids = heldout_token_ids(engine.tokenizer)
            ppl[name] = perplexity(engine, ids, WINDOW, NUM_WINDOWS)
    return ppl, str(paths["smoothquant"])


def test_smoothquant_perplexity_within_3_percent(smol_results):
    ppl, _ = smol_results
    print(ppl)
    assert ppl["smoothquant"] <= 1.03 * ppl["float32"]


def test_smoothing_earns_its_keep(smol_results):
    ppl, _ = smol_results
    assert ppl["w8a8_no_smoothing"] > ppl["smoothquant"]


# Questions whose float32 greedy answer is not a near tie: the plain "What is the capital of
# France?" is one in float32 itself ("The" leads "L" by 0.08 nats, then "L'Étoile ..."), so
# any quantization, or the same model on another CPU, may flip it.
QUESTIONS = {
    "Name the capital of France.": "Paris",
    "What is the capital of Japan?": "Tokyo",
    "What is the chemical symbol for water?": "H2O",
}
CONFIDENT_NATS, CONFIDENT_TOKENS = 0.4, 8


def _chat_answers(path: str) -> list:
    from lmengine import pipeline

    gen = GenerationConfig(max_new_tokens=24, logprobs=2)
    with pipeline(path) as pipe:
        return pipe([[{"role": "user", "content": q}] for q in QUESTIONS], gen_config=gen)


def test_chat_answers_still_right(smol_results, smollm2_path):
    _, path = smol_results
    for (question, answer), out in zip(QUESTIONS.items(), _chat_answers(smollm2_path)):
        # the premise: float32 answers right, its first tokens clearly ahead of the runner-up
        assert answer in out.text, (question, out.text)
        for top in out.logprobs[:CONFIDENT_TOKENS]:
            best, second = sorted(top.values(), reverse=True)[:2]
            assert best - second > CONFIDENT_NATS, (question, out.text, top)
    for (question, answer), out in zip(QUESTIONS.items(), _chat_answers(path)):
        assert answer in out.text, (question, out.text)
