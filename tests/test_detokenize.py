from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lmengine.engine.detokenize import IncrementalDetokenizer

TEXTS = [
    "héllo wörld, ça va? 🙂🚀 日本語のテキスト — done.",
    "Ünïcödé: ∑ ∫ √ ≈ ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "plain ascii with  double  spaces\nand lines",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_are_whole_characters_and_join_to_decode(smollm2_path, text):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tok("Say:")["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(tok, prompt)
    deltas = [det.add(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == det.text
    if not text.isascii():
        assert any(d == "" for d in deltas), "some token ends mid-character and waits"


def test_special_tokens_skipped_or_kept(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok("Paris.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for t in ids:
        skip.add(t)
        keep.add(t)
    assert skip.text == "Paris." and keep.text == "Paris." + tok.eos_token
