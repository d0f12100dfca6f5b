"""POST /v1/embeddings on a real `lmengine serve`, through the official `openai` client: the
vectors equal transformers' final hidden state at the last token, L2-normalized; texts and
token ids; base64 (the client's default) and float encodings; usage; refusals (a width the
model does not have, an unknown model, an empty input) as 4xx with the server alive."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.hf_reference import hf_forward
from tests.test_server import AUTH, TINY_OPENAI_FLAGS, openai_client, tiny_server, wait_idle

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

TEXTS = ["The capital of France is", "a", "Embeddings\nfrom a decoder model, pooled."]


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    with tiny_server(tiny_llama_path, *TINY_OPENAI_FLAGS) as url:
        yield url


def expected(path: str, ids: list[int]) -> torch.Tensor:
    last = hf_forward(path, ids)[1][-1][-1]  # after the final norm, at the last token
    return torch.nn.functional.normalize(last.float(), dim=-1)


def test_vectors_equal_transformers_last_token(server, tiny_llama_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    client = openai_client(server)
    ids = [list(tokenizer(t)["input_ids"]) for t in TEXTS]
    answer = client.embeddings.create(model="tiny", input=TEXTS)  # base64 under the hood
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model="tiny", input=ids + [ids[0]])
    single = client.embeddings.create(model="tiny", input=TEXTS[2], dimensions=64)
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "tiny"
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for i, want in enumerate(expected(tiny_llama_path, x) for x in ids):
        for got in (answer.data[i], floats.data[i], by_ids.data[i]):
            vector = torch.tensor(got.embedding)
            assert vector.shape == (64,)
            assert float(torch.dot(vector, want)) > 0.9999
    assert by_ids.data[3].embedding == by_ids.data[0].embedding  # the same input, the same vector
    assert single.data[0].embedding == floats.data[2].embedding
    assert wait_idle(server)["lmengine_kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "kwargs, status, message",
    [
        (dict(model="tiny", input="x", dimensions=10), 400, "dimensions: Input should be 64"),
        (dict(model="nope", input="x"), 404, "does not exist"),
        (dict(model="tiny", input=""), 400, "input"),
        (dict(model="tiny", input=[[]]), 400, "input"),
    ],
)
def test_refusals_are_4xx_and_the_server_goes_on(server, kwargs, status, message):
    r = httpx.post(server + "/v1/embeddings", json=kwargs, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert len(openai_client(server).embeddings.create(model="tiny", input="ok").data) == 1


def test_the_client_raises_on_a_refusal(server):
    with pytest.raises(openai.BadRequestError, match="Input should be 64"):
        openai_client(server).embeddings.create(model="tiny", input="x", dimensions=3)
