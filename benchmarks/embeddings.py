"""Embeddings, measured: `--num-texts` texts of ~`--text-tokens` tokens through a running
`lmengine serve` (`POST /v1/embeddings`, the openai client, `--batch` texts per request,
`--concurrency` requests at once) against the same texts through transformers in batches
(`--hf-batch-size`, padded on the right; the final norm's output at each text's last token,
L2-normalized, as the server computes it). Both at their defaults (lmengine's dtype as it
ships; transformers' model loaded as its checkpoint says); the systems take turns, `--rounds`
times, on an idle machine.

    python benchmarks/embeddings.py                  # SmolLM2-135M-Instruct, 1,000 texts
    python benchmarks/embeddings.py --quick          # a smoke test with small sizes

Reports texts/s and tokens/s of each, their ratio, and the lowest cosine between the two
systems' vectors of a text.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import start_server, stop  # noqa: E402
from lmengine.bench.report import busy_fraction, check_idle, cpu_model  # noqa: E402
from lmengine.engine.loader import resolve_model_path  # noqa: E402
from lmengine.quant.eval import heldout_token_ids  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_texts(tokenizer, num_texts: int, text_tokens: int, seed: int) -> list[str]:
    """Texts decoded from `text_tokens`-token windows of the held-out text at random offsets."""
    ids = heldout_token_ids(tokenizer)
    rng = random.Random(seed)
    texts = []
    while len(texts) < num_texts:
        at = rng.randrange(0, len(ids) - text_tokens)
        texts.append(tokenizer.decode(ids[at : at + text_tokens]))
    return texts


def lmengine_embed(url: str, texts: list[str], batch: int, concurrency: int) -> list:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    parts = [texts[i : i + batch] for i in range(0, len(texts), batch)]

    def one(part: list[str]) -> list:
        data = client.embeddings.create(model="bench", input=part, encoding_format="float").data
        return [torch.tensor(d.embedding) for d in data]

    with ThreadPoolExecutor(concurrency) as pool:
        return [v for vectors in pool.map(one, parts) for v in vectors]


def hf_embed(model, tokenizer, texts: list[str], batch: int) -> list:
    """transformers: the backbone over right-padded batches, the last real token's final
    hidden state, L2-normalized."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i : i + batch], return_tensors="pt", padding=True)
            hidden = model.model(**enc).last_hidden_state  # [b, len, hidden]
            last = enc["attention_mask"].sum(1) - 1
            rows = hidden[torch.arange(hidden.shape[0]), last].float()
            out.extend(torch.nn.functional.normalize(rows, dim=-1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks/embeddings.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-texts", type=int, default=1000)
    parser.add_argument("--text-tokens", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32, help="texts per /v1/embeddings request")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at once")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument(
        "--hf-dtype", default="auto", help="transformers' dtype (default: the checkpoint's)"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--serve-flags", default="", help="extra `lmengine serve` flags")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--force", action="store_true", help="run on a busy machine")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_texts, args.text_tokens = 16, 20
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_idle(args.force or args.quick, wait_s=60)
    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    texts = make_texts(tokenizer, args.num_texts, args.text_tokens, seed=0)
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    report = {
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "loadavg_at_start": list(os.getloadavg()),
        "busy_fraction_at_start": round(busy_fraction(), 3),
        "num_texts": len(texts),
        "num_tokens": num_tokens,
        "rounds": [],
    }
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=args.hf_dtype).eval()
    report["transformers_dtype"] = str(hf_model.dtype).removeprefix("torch.")
    proc, url = start_server(
        model_path, ["--served-model-name", "bench", *args.serve_flags.split()]
    )
    try:
        lmengine_embed(url, texts[: args.batch], args.batch, 1)  # warm-up
        hf_embed(hf_model, tokenizer, texts[: args.hf_batch_size], args.hf_batch_size)
        for r in range(args.rounds):
            order = ["lmengine", "transformers"] if r % 2 == 0 else ["transformers", "lmengine"]
            seconds, vectors = {}, {}
            for name in order:
                start = time.perf_counter()
                if name == "lmengine":
                    vectors[name] = lmengine_embed(url, texts, args.batch, args.concurrency)
                else:
                    vectors[name] = hf_embed(hf_model, tokenizer, texts, args.hf_batch_size)
                seconds[name] = time.perf_counter() - start
                log(f"round {r + 1} {name}: {len(texts) / seconds[name]:.1f} texts/s")
            cosines = [
                float(torch.dot(a, b)) for a, b in zip(vectors["lmengine"], vectors["transformers"])
            ]
            report["rounds"].append(
                {
                    "texts_per_s": {k: len(texts) / v for k, v in seconds.items()},
                    "tokens_per_s": {k: num_tokens / v for k, v in seconds.items()},
                    "lmengine_over_transformers": seconds["transformers"] / seconds["lmengine"],
                    "min_cosine": min(cosines),
                }
            )
    finally:
        stop(proc)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
