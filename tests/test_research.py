"""Research hooks against transformers: prompt logprobs, hidden states, steering and logits
processors, for requests batched with others, under chunked prefill, preemption (recompute
and swap), prefix caching and speculative decoding; and bad research input."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.config import SteeringVector
from tests.engine_utils import random_prompts, run_threads
from tests.hf_reference import _load, hf_forward, hf_greedy

TOL = 1e-4
CASES = {
    "batched": dict(block_size=4, num_gpu_blocks=1024),
    "chunked": dict(block_size=4, num_gpu_blocks=1024, max_prefill_token_num=7),
    "preempt": dict(block_size=4, num_gpu_blocks=24),
    "swap": dict(block_size=4, num_gpu_blocks=24, eviction_type="swap", num_cpu_blocks=400),
    "prefix": dict(block_size=4, num_gpu_blocks=1024, enable_prefix_caching=True),
    "speculative": dict(block_size=4, num_gpu_blocks=1024, speculative="ngram"),
}


def check_prompt_logprobs(path, prompt, got, num_top):
    lp, _ = hf_forward(path, prompt)
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        entry = got[i]
        assert abs(entry[prompt[i]] - lp[i - 1, prompt[i]].item()) < TOL, i
        top_values, top_ids = lp[i - 1].topk(num_top)
        for t, v in zip(top_ids.tolist(), top_values.tolist()):
            assert abs(entry[t] - v) < TOL, (i, t)
        assert len(entry) in (num_top, num_top + 1)


def check_hidden_states(path, tokens, got, layers):
    """`got` covers every position run: all of `tokens` but the last generated one."""
    _, hidden = hf_forward(path, tokens)
    for layer in layers:
        want = hidden[layer][: got[layer].shape[0]]
        assert got[layer].shape == want.shape
        torch.testing.assert_close(got[layer], want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logprobs_and_hidden_states_equal_transformers(tiny_llama_path, name):
    path = tiny_llama_path
    cfg = EngineConfig(**CASES[name])
    prompts = random_prompts([23, 9, 31, 17, 40, 12, 28, 35], 49152, seed=3)
    if name in ("prefix", "speculative"):  # shared prefixes; repeats that prompt lookup finds
        prompts = [prompts[0][:16] + p for p in prompts]
    asks = [
        dict(prompt_logprobs=3),
        dict(output_hidden_states=(0, 1, 2)),
        dict(),
        dict(prompt_logprobs=0, output_hidden_states="all"),
    ]
    configs = [
        GenerationConfig(max_new_tokens=10, ignore_eos=True, **asks[i % len(asks)])
        for i in range(len(prompts))
    ]
    expected = hf_greedy(path, prompts, 10, ignore_eos=True)
    with Engine.from_pretrained(path, cfg) as engine:
        if name == "prefix":  # fill the cache with the shared prefix first
            run_threads(engine, prompts[:1], GenerationConfig(max_new_tokens=1))
        # NOTE: together: the first step must see every request, or the pool may not fill
        results = run_threads(engine, prompts, configs, together=name in ("preempt", "swap"))
        stats = engine.stats()
        engine.check_integrity()
    if name in ("preempt", "swap"):
        assert stats["num_preemptions"] > 0, "the small pool was meant to preempt"
    for prompt, c, r, want in zip(prompts, configs, results, expected):
        assert r.finish_reason == "length", r.error
        assert r.token_ids == want
        if c.prompt_logprobs is not None:
            check_prompt_logprobs(path, prompt, r.prompt_logprobs, c.prompt_logprobs)
        else:
            assert r.prompt_logprobs is None
        if c.output_hidden_states is not None:
            layers = (0, 1, 2) if c.output_hidden_states == "all" else c.output_hidden_states
            assert sorted(r.hidden_states) == list(layers)
            assert r.hidden_states[0].shape[0] == len(prompt) + len(want) - 1
            check_hidden_states(path, prompt + want, r.hidden_states, layers)
        else:
            assert r.hidden_states is None


def test_max_new_tokens_zero_scores_the_prompt_only(tiny_llama_path):
    prompt = random_prompts([30], 49152, seed=5)[0]
    cfg = GenerationConfig(max_new_tokens=0, prompt_logprobs=2, output_hidden_states=(2,))
    with Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=64)) as engine:
        r = engine.create_instance().infer(0, prompt, gen_config=cfg)
        stats = engine.stats()
    assert (r.finish_reason, r.token_ids, r.generate_token_len) == ("length", [], 0)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    check_prompt_logprobs(tiny_llama_path, prompt, r.prompt_logprobs, 2)
    assert r.hidden_states[2].shape[0] == len(prompt)  # every prompt position ran
    check_hidden_states(tiny_llama_path, prompt, r.hidden_states, (2,))


class AddAtLayer:
    """A transformers forward hook adding `vector` to a decoder layer's output at positions
    >= start (positions counted across generate's forwards)."""

    def __init__(self, vector: torch.Tensor, start: int = 0) -> None:
        self.vector, self.start, self.pos = vector, start, 0

    def __call__(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        n = out.shape[1]
        mask = (torch.arange(self.pos, self.pos + n) >= self.start).to(out.dtype)[:, None]
        self.pos += n
        out = out + mask * self.vector
        return (out, *output[1:]) if isinstance(output, tuple) else out


def hf_steered(path, prompt, steering: dict[int, SteeringVector], max_new_tokens: int):
    model = _load(path)
    handles = [
        model.model.layers[layer - 1].register_forward_hook(
            AddAtLayer(sv.vector * sv.scale, sv.start)
        )
        for layer, sv in steering.items()
    ]
    try:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False
            )
    finally:
        for h in handles:
            h.remove()
    return out[0, len(prompt) :].tolist()


def test_steering_equals_transformers_hook_and_leaves_the_batch_alone(tiny_llama_path):
    path = tiny_llama_path
    gen = torch.Generator().manual_seed(0)
    prompts = random_prompts([20, 14, 26, 11, 18, 22], 49152, seed=7)
    steerings = [
        {1: SteeringVector(torch.randn(64, generator=gen) * 4)},
        None,
        {2: SteeringVector(torch.randn(64, generator=gen), scale=6.0, start=24)},
        None,
        {
            1: SteeringVector(torch.randn(64, generator=gen), scale=3.0),
            2: SteeringVector(torch.randn(64, generator=gen) * 2, start=5),
        },
        None,
    ]
    configs = [GenerationConfig(max_new_tokens=12, ignore_eos=True, steering=s) for s in steerings]
    plain = hf_greedy(path, prompts, 12, ignore_eos=True)
    cfg = EngineConfig(block_size=4, num_gpu_blocks=1024, max_prefill_token_num=9)
    with Engine.from_pretrained(path, cfg) as engine:
        results = run_threads(engine, prompts, configs, stagger_s=0.0)
        engine.check_integrity()
    for prompt, s, r, want in zip(prompts, steerings, results, plain):
        if s is None:
            assert r.token_ids == want  # the other rows of the batch are untouched
        else:
            assert r.token_ids == hf_steered(path, prompt, s, 12)
            assert r.token_ids != want  # the vectors are large enough to change the output


def test_steered_blocks_never_serve_other_requests(tiny_llama_path):
    prompt = random_prompts([33], 49152, seed=9)[0]
    steer = {1: SteeringVector(torch.full((64,), 3.0))}
    cfg = EngineConfig(block_size=4, num_gpu_blocks=256, enable_prefix_caching=True)
    with Engine.from_pretrained(tiny_llama_path, cfg) as engine:
        inst = engine.create_instance()
        steered = inst.infer(
            0, prompt, gen_config=GenerationConfig(max_new_tokens=6, steering=steer)
        )
        plain = inst.infer(1, prompt, gen_config=GenerationConfig(max_new_tokens=6))
    assert plain.token_ids == hf_greedy(tiny_llama_path, [prompt], 6)[0]
    assert steered.token_ids == hf_steered(tiny_llama_path, prompt, steer, 6)


def ban_and_bias(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A processor that depends on the history: ban every id below 100, push up a token that
    depends on the last one."""
    logits[:100] = float("-inf")
    logits[(token_ids[-1] * 7919) % logits.shape[0]] += 30.0
    return logits


class AsTransformers:
    """Our processor convention wrapped for transformers' LogitsProcessorList."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, input_ids, scores):
        for b in range(scores.shape[0]):
            scores[b] = self.fn(input_ids[b].tolist(), scores[b].clone())
        return scores


@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_logits_processor_equals_transformers(tiny_llama_path, repetition_penalty):
    path = tiny_llama_path
    prompts = random_prompts([15, 22, 9], 49152, seed=11)
    model = _load(path)
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=10,
                do_sample=False,
                repetition_penalty=repetition_penalty,
                logits_processor=LogitsProcessorList([AsTransformers(ban_and_bias)]),
            )
            want.append(out[0, len(p) :].tolist())
    configs = [
        GenerationConfig(
            max_new_tokens=10,
            repetition_penalty=repetition_penalty,
            logits_processors=[ban_and_bias] if i != 1 else None,
        )
        for i in range(len(prompts))
    ]
    with Engine.from_pretrained(path, EngineConfig(block_size=4, num_gpu_blocks=256)) as engine:
        results = run_threads(engine, prompts, configs, stagger_s=0.0)
    assert results[0].token_ids == want[0]
    assert results[2].token_ids == want[2]
    if repetition_penalty == 1.0:
        assert results[1].token_ids == hf_greedy(path, prompts[1:2], 10)[0]


def raises(token_ids, logits):
    raise RuntimeError("processor bug")


def returns_wrong_shape(token_ids, logits):
    return logits[:10]


BAD_ASKS = {
    "hidden layer out of range": (dict(output_hidden_states=(3,)), "layer 3 is out of range"),
    "steering layer out of range": (
        dict(steering={3: torch.zeros(64)}),
        "steering: layer 3 is out of range",
    ),
    "vector of the wrong size": (dict(steering={1: torch.zeros(65)}), "must have shape (64,)"),
    "vector of the wrong dtype": (
        dict(steering={1: torch.zeros(64, dtype=torch.int64)}),
        "must be float32, float16 or bfloat16",
    ),
    "vector with NaN": (dict(steering={1: torch.full((64,), float("nan"))}), "NaN or infinite"),
    "processor raises": (dict(logits_processors=[raises]), "RuntimeError: processor bug"),
    "processor returns a bad row": (
        dict(logits_processors=[returns_wrong_shape]),
        "must return a tensor of shape (49152,), got (10,)",
    ),
}


def test_bad_research_input_fails_that_request_only(tiny_llama_path):
    path = tiny_llama_path
    prompts = random_prompts([12] * (2 * len(BAD_ASKS)), 49152, seed=13)
    configs = []
    for ask, _ in BAD_ASKS.values():
        configs += [GenerationConfig(max_new_tokens=6, **ask), GenerationConfig(max_new_tokens=6)]
    cfg = EngineConfig(block_size=4, num_gpu_blocks=256)
    with Engine.from_pretrained(path, cfg) as engine:
        results = run_threads(engine, prompts, configs, stagger_s=0.0)
        engine.check_integrity()
        stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    expected = hf_greedy(path, prompts[1::2], 6)
    for (name, (_, message)), bad, good, want in zip(
        BAD_ASKS.items(), results[::2], results[1::2], expected
    ):
        assert bad.finish_reason == "error", name
        assert message in bad.error, (name, bad.error)
        assert good.finish_reason == "length" and good.token_ids == want, name


def test_config_checks_the_shape_of_research_fields():
    bad = [
        (dict(prompt_logprobs=21), "prompt_logprobs must be <= 20"),
        (dict(output_hidden_states=()), "output_hidden_states must be layer indices"),
        (dict(output_hidden_states=(-1,)), "output_hidden_states[] must be >= 0"),
        (dict(steering={0: torch.zeros(4)}), "steering layer must be >= 1"),
        (dict(steering={1: [0.0]}), "a steering vector must be a tensor"),
        (dict(logits_processors=[1]), "logits_processors must be a list of callables"),
        (dict(num_beams=2, prompt_logprobs=1), "beam search does not support prompt_logprobs"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
            GenerationConfig(**kwargs)
    assert GenerationConfig(output_hidden_states=[2, 0, 2]).output_hidden_states == (0, 2)


def test_pipeline_score_texts_and_pairs_equal_transformers(tiny_llama_path):
    from lmengine import Pipeline

    path = tiny_llama_path
    texts = ["The quick brown fox jumps over the lazy dog.", "Paged attention, scored."]
    pairs = [("Question: 2 + 2 =", " 4"), ("The capital of France is ", "Paris")]
    ids = random_prompts([19], 49152, seed=17)[0]
    cfg = EngineConfig(block_size=4, num_gpu_blocks=256, max_prefill_token_num=8)
    with Pipeline(Engine.from_pretrained(path, cfg)) as pipe:
        scores = pipe.score([*texts, *pairs, ids, (ids[:5], ids[5:]), ("a", ""), list(range(1100))])
        single = pipe.score(texts[0])
        context, continuation = pipe.encode_pair(*pairs[1])
        tok = pipe.tokenizer
    assert single.logprobs == scores[0].logprobs
    # the trailing space of the context moves to the continuation, as lm-eval does
    assert context == tok("The capital of France is", add_special_tokens=False)["input_ids"]
    assert tok.decode(continuation) == " Paris"
    for item, score in zip([*texts, *pairs, ids, (ids[:5], ids[5:])], scores):
        assert score.error is None
        if isinstance(item, str):
            tokens, first = tok(item)["input_ids"], 1
        elif isinstance(item, list):
            tokens, first = item, 1
        elif isinstance(item[0], str):
            c, x = pipe.encode_pair(*item)
            tokens, first = c + x, len(c)
        else:
            tokens, first = item[0] + item[1], len(item[0])
        lp, _ = hf_forward(path, tokens)
        want = [lp[i - 1, tokens[i]].item() for i in range(first, len(tokens))]
        assert score.token_ids == tokens[first:]
        assert score.logprobs == pytest.approx(want, abs=TOL)
        assert score.sum_logprob == pytest.approx(sum(want), abs=10 * TOL)
        greedy = all(lp[i - 1].argmax().item() == tokens[i] for i in range(first, len(tokens)))
        assert score.is_greedy == greedy
    assert "non-empty context and continuation" in scores[-2].error
    assert "session_len" in scores[-1].error


def test_scoring_from_a_start_reuses_cached_contexts(tiny_llama_path):
    """Pairs sharing a context (multiple choice): with prefix caching the context's blocks are
    computed once, and the continuations' logprobs still equal transformers'."""
    from lmengine import Pipeline

    path = tiny_llama_path
    contexts = random_prompts([41, 37, 50], 49152, seed=19)
    choices = random_prompts([3, 6, 4, 5], 49152, seed=20)
    pairs = [(c, x) for c in contexts for x in choices]
    cfg = EngineConfig(block_size=4, num_gpu_blocks=512, enable_prefix_caching=True)
    with Pipeline(Engine.from_pretrained(path, cfg)) as pipe:
        scores = pipe.score(pairs)
        stats = pipe.engine.stats()
        engine_scores = pipe.engine.create_instance().infer(
            0,
            contexts[0] + choices[0],
            gen_config=GenerationConfig(
                max_new_tokens=0, prompt_logprobs=0, prompt_logprobs_start=len(contexts[0])
            ),
        )
    # the first pair of each context computes it; the other three start from its blocks
    assert stats["num_prefix_cached_tokens"] >= 3 * 3 * 36
    for (c, x), score in zip(pairs, scores):
        lp, _ = hf_forward(path, c + x)
        want = [lp[len(c) + j - 1, t].item() for j, t in enumerate(x)]
        assert score.token_ids == x
        assert score.logprobs == pytest.approx(want, abs=TOL)
    entries = engine_scores.prompt_logprobs
    assert entries[: len(contexts[0])] == [None] * len(contexts[0])
    assert all(e is not None for e in entries[len(contexts[0]) :])


@pytest.mark.parametrize(
    "context, continuation",
    [("Flour,", ". Some erupt"), ("The capital of France is ", "Paris"), ("Q: 2+2=", "4\n")],
)
def test_encode_pair_splits_as_lm_eval(smollm2_path, context, continuation):
    """lm-eval's own split (TemplateLM._encode_pair), also where a token merges across the
    boundary (",." here): the scores then equal its hf backend's."""
    from types import SimpleNamespace

    from lm_eval.api.model import TemplateLM
    from transformers import AutoTokenizer

    from lmengine.api import Pipeline

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    fake = SimpleNamespace(
        backend="causal", tok_encode=lambda s: tok(s, add_special_tokens=False)["input_ids"]
    )
    want = TemplateLM._encode_pair(fake, context, continuation)
    pipe = Pipeline.__new__(Pipeline)
    pipe.tokenizer = tok
    assert pipe.encode_pair(context, continuation) == (list(want[0]), list(want[1]))


def _hf_embedding(path: str, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden state (after the final norm) pooled, L2-normalized."""
    last = hf_forward(path, ids)[1][-1]  # [len, hidden]
    pooled = last[-1] if pooling == "last" else last.mean(0)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def test_embeddings_equal_transformers_beside_generation(tiny_llama_path):
    """Pipeline.embed: the final norm's output at the last token (or its mean), normalized,
    equal to transformers', for texts and token ids run in chunks while generation requests
    share the batches; "last" takes cached prefixes the second time, "mean" runs every
    position; the same input gives the same vector."""
    import threading

    from lmengine import Pipeline

    path = tiny_llama_path
    shared = random_prompts([12], 49152, seed=21)[0]
    prompts = [shared + p for p in random_prompts([3, 9, 17, 30, 1], 49152, seed=22)]
    generating = random_prompts([14, 6, 25], 49152, seed=23)
    expected_tokens = hf_greedy(path, generating, 10, ignore_eos=True)
    cfg = EngineConfig(
        block_size=4, num_gpu_blocks=1024, max_prefill_token_num=7, enable_prefix_caching=True
    )
    with Pipeline(Engine.from_pretrained(path, cfg)) as pipe:
        texts = ["The capital of France is", "  spaces, then\nlines"]
        generated: list = []
        worker = threading.Thread(
            target=lambda: generated.extend(
                pipe(generating, GenerationConfig(max_new_tokens=10, ignore_eos=True))
            )
        )
        worker.start()
        first = pipe.embed(prompts + texts)
        worker.join()
        cached_before = pipe.engine.stats()["num_prefix_cached_tokens"]
        again = pipe.embed(prompts)
        cached_last = pipe.engine.stats()["num_prefix_cached_tokens"]
        mean = pipe.embed(prompts, pooling="mean")
        cached_mean = pipe.engine.stats()["num_prefix_cached_tokens"]
        raw = pipe.embed(prompts[0], normalize=False)
        text_ids = [list(pipe.tokenizer(t)["input_ids"]) for t in texts]
        with pytest.raises(ValueError, match="text 1 cannot be embedded"):
            pipe.embed([prompts[0], []])
        pipe.engine.check_integrity()
        stats = pipe.engine.stats()
    assert [r.token_ids for r in generated] == expected_tokens
    for ids, got in zip(prompts + text_ids, first):
        assert got.dtype == torch.float32 and got.shape == (64,)
        torch.testing.assert_close(got, _hf_embedding(path, ids, "last"), rtol=1e-4, atol=1e-4)
    for ids, got in zip(prompts, mean):
        torch.testing.assert_close(got, _hf_embedding(path, ids, "mean"), rtol=1e-4, atol=1e-4)
    assert cached_last > cached_before  # "last" read the shared prefixes from the cache
    assert cached_mean == cached_last  # "mean" ran every position
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(raw) == 1 and abs(float(raw[0].norm()) - 1.0) > 1e-3  # not normalized
    torch.testing.assert_close(
        torch.nn.functional.normalize(raw[0], dim=-1), first[0], rtol=1e-5, atol=1e-5
    )
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0, pooling="max"), "pooling must be one of last, mean or None"),
        (dict(max_new_tokens=4, pooling="last"), "max_new_tokens must be 0, got 4"),
    ],
)
def test_bad_pooling_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)
