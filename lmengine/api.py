"""`pipeline(...)`: prompts in, Responses with text out, over one Engine.

A prompt is a string, a list of chat messages (`[{"role": ..., "content": ...}]`) or a list of
token ids. Strings and messages go through the tokenizer's chat template when it has one (as
lmdeploy does); pass `apply_chat_template=False` to send strings raw. `Pipeline.score` scores
texts or (context, continuation) pairs instead: log-likelihoods from the prompt's logprobs.
`Pipeline.embed` embeds texts: the final norm's output pooled over each text (no template).
"""

from __future__ import annotations

import math
import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from lmengine.config import EngineConfig, GenerationConfig
from lmengine.engine.engine import Engine
from lmengine.engine.request import Answer, Response, new_queue

Prompt = str | list[dict] | list[int]


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat messages through the tokenizer's template, ready for the reply."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def _responses(responses: queue.Queue, num_requests: int) -> Iterator[Response]:
    """Every Response of `num_requests` requests sharing one queue, until all have finished.
    The engine may put one step's responses as a list."""
    remaining = num_requests
    while remaining:
        item = responses.get()
        for r in item if isinstance(item, list) else (item,):
            if r.finish_reason is not None:
                remaining -= 1
            yield r


@dataclass
class Score:
    """The log-likelihood of one scored item: of every token of a text after its first, or
    of the continuation of a (context, continuation) pair given its context."""

    token_ids: list[int] = field(default_factory=list)  # the scored tokens
    logprobs: list[float] = field(default_factory=list)  # log p(token | all tokens before it)
    is_greedy: bool = False  # every scored token is the model's most likely one
    index: int = 0  # position of the item in the batch
    error: str | None = None  # why the item could not be scored (then nothing else is set)

    @property
    def sum_logprob(self) -> float:
        return math.fsum(self.logprobs)

    @property
    def perplexity(self) -> float:
        """exp(mean negative log-likelihood per scored token)."""
        return math.exp(-self.sum_logprob / len(self.logprobs)) if self.logprobs else math.nan


ScoreItem = str | list[int] | tuple[str, str] | tuple[list[int], list[int]]


class Pipeline:
    """Batch generation over an Engine; a context manager that closes the engine."""

    def __init__(self, engine: Engine, apply_chat_template: bool = True) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.apply_chat_template = apply_chat_template

    # ---- prompts ------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        if isinstance(prompt, str):
            if not (self.apply_chat_template and has_template):
                return list(self.tokenizer(prompt)["input_ids"])
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            if not has_template:
                raise ValueError("chat messages given but the tokenizer has no chat template")
            return chat_token_ids(self.tokenizer, prompt)
        raise ValueError(
            f"a prompt must be a string, a list of chat messages or token ids, got {prompt!r:.80}"
        )

    @staticmethod
    def _as_batch(prompts) -> tuple[list[Prompt], bool]:
        """(list of prompts, whether a single prompt was given)."""
        if isinstance(prompts, str):
            return [prompts], True
        if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
            return [prompts], True
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [prompts], True
        return list(prompts), False

    def _submit(
        self, prompts: list[Prompt], gen_config, adapter_name, priority, responses, user_id=None
    ):
        configs = gen_config if isinstance(gen_config, list) else [gen_config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError(f"{len(configs)} gen_configs for {len(prompts)} prompts")
        adapters = adapter_name if isinstance(adapter_name, list) else [adapter_name] * len(prompts)
        users = user_id if isinstance(user_id, list) else [user_id] * len(prompts)
        if len(adapters) != len(prompts) or len(users) != len(prompts):
            raise ValueError("adapter_name and user_id lists need one entry per prompt")
        for i, (prompt, cfg, adapter, user) in enumerate(zip(prompts, configs, adapters, users)):
            try:
                ids = self.encode(prompt)
            except ValueError as e:
                responses.put(Response(finish_reason="error", error=str(e), index=i))
                continue
            self._add(ids, cfg, responses, i, adapter, priority, user)

    def _add(self, ids, cfg, responses, index, adapter=None, priority=None, user=None) -> None:
        """Submit one request whose Responses go to `responses`, tagged with `index`."""
        client = self.engine.client
        options = dict(adapter_name=adapter, priority=priority, user_id=user)
        client.submit(client.request(ids, cfg, response_queue=responses, index=index, **options))

    # ---- generation ---------------------------------------------------------------------------
    def stream_infer(
        self,
        prompts,
        gen_config: GenerationConfig | list[GenerationConfig] | None = None,
        adapter_name: str | list[str] | None = None,
        priority: int | None = None,
        user_id: str | list[str] | None = None,
    ) -> Iterator[Response]:
        """Yield deltas: each Response carries the new text and new token ids of prompt
        `r.index` since its previous delta; the last one of a prompt has its finish_reason.
        `adapter_name` and `user_id` (the QoS user) are one value or a list, one per prompt."""
        batch, _ = self._as_batch(prompts)
        responses = new_queue()
        self._submit(batch, gen_config, adapter_name, priority, responses, user_id)
        yield from _responses(responses, len(batch))  # NOTE: the engine sends deltas

    def __call__(
        self,
        prompts,
        gen_config: GenerationConfig | list[GenerationConfig] | None = None,
        adapter_name: str | list[str] | None = None,
        priority: int | None = None,
        use_tqdm: bool = False,
        user_id: str | list[str] | None = None,
    ) -> list[Response] | Response:
        """Generate for every prompt; returns one final Response per prompt (in order), or a
        single Response when a single prompt was given."""
        batch, single = self._as_batch(prompts)
        responses = new_queue()
        self._submit(batch, gen_config, adapter_name, priority, responses, user_id)
        answers = [Answer() for _ in batch]
        finals: list[Response | None] = [None] * len(batch)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(batch), desc="generating", unit="prompt")
        for r in _responses(responses, len(batch)):
            answers[r.index].add(r)
            if r.finish_reason is not None:
                finals[r.index] = answers[r.index].response(copy=False)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return finals[0] if single else finals

    # ---- scoring ------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation), split as lm-evaluation-harness does: the
        context's tokens, then the tokens of the whole text after as many (spaces ending the
        context move to the continuation; an empty context becomes the BOS, else EOS,
        token)."""
        num_spaces = len(context) - len(context.rstrip())
        if num_spaces:
            context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
        encode = self.tokenizer
        if not context:
            prefix = self.tokenizer.bos_token_id
            prefix = self.tokenizer.eos_token_id if prefix is None else prefix
            return [prefix], list(encode(continuation, add_special_tokens=False)["input_ids"])
        whole = list(encode(context + continuation, add_special_tokens=False)["input_ids"])
        context_ids = list(encode(context, add_special_tokens=False)["input_ids"])
        # NOTE: lm-eval's split exactly: the context's own tokens, then the whole text's tokens
        # after as many (where a token merges across the boundary, its text is dropped)
        return context_ids, whole[len(context_ids) :]

    def _score_ids(self, item: ScoreItem) -> tuple[list[int], int]:
        """(token ids, index of the first scored token) of one item."""
        if isinstance(item, str):
            return list(self.tokenizer(item)["input_ids"]), 1
        if isinstance(item, tuple) and len(item) == 2:
            context, continuation = item
            if isinstance(context, str) and isinstance(continuation, str):
                context, continuation = self.encode_pair(context, continuation)
            if not (isinstance(context, list) and isinstance(continuation, list)):
                raise ValueError("a pair is (context, continuation), both texts or both token ids")
            if not context or not continuation:
                raise ValueError("a pair needs a non-empty context and continuation")
            return [*context, *continuation], len(context)
        if isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            return list(item), 1
        raise ValueError(
            "an item to score is a text, token ids or a (context, continuation) pair, "
            f"got {item!r:.80}"
        )

    def score(
        self, items: ScoreItem | Sequence[ScoreItem], adapter_name: str | None = None
    ) -> list[Score] | Score:
        """Log-likelihoods of texts (every token after the first), token-id lists, or
        (context, continuation) pairs (the continuation's tokens given the context), batched
        through the engine in one prefill each (no generation, no chat template). Returns one
        Score per item, in order, or a single Score for a single item.

        Only the scored tokens get logits. With prefix caching on, pairs that share a context
        (the choices of a multiple-choice question) compute it once: the first pair of each
        context runs first, and the others start from its cached blocks."""
        single = isinstance(items, (str, tuple)) or (
            isinstance(items, list) and bool(items) and all(isinstance(t, int) for t in items)
        )
        batch = [items] if single else list(items)
        scores = [Score(index=i) for i in range(len(batch))]
        firsts: list[tuple[int, list[int], int]] = []  # (index, ids, first scored token)
        others: list[tuple[int, list[int], int]] = []  # pairs whose context came before
        contexts: set[tuple[int, ...]] = set()
        for i, item in enumerate(batch):
            try:
                ids, start = self._score_ids(item)
            except ValueError as e:
                scores[i].error = str(e)
                continue
            context = tuple(ids[:start])
            (others if context in contexts else firsts).append((i, ids, start))
            contexts.add(context)
        if self.engine.engine_config.enable_prefix_caching:
            self._score_batch(firsts, adapter_name, scores)
            self._score_batch(others, adapter_name, scores)
        else:  # nothing to reuse: one batch
            self._score_batch(firsts + others, adapter_name, scores)
        return scores[0] if single else scores

    def _score_batch(self, items: list[tuple[int, list[int], int]], adapter_name, scores) -> None:
        """Score (index, token ids, first scored token) items at once into `scores`."""
        responses = new_queue()
        for i, ids, start in items:
            cfg = GenerationConfig(max_new_tokens=0, prompt_logprobs=1, prompt_logprobs_start=start)
            self._add(ids, cfg, responses, i, adapter_name)
        asked = {i: (ids, start) for i, ids, start in items}
        for r in _responses(responses, len(items)):
            if r.finish_reason is None:
                continue
            s = scores[r.index]
            if r.finish_reason == "error":
                s.error = r.error
                continue
            ids, start = asked[r.index]
            s.token_ids = ids[start:]
            entries = r.prompt_logprobs[start:]
            s.logprobs = [e[t] for t, e in zip(s.token_ids, entries)]
            s.is_greedy = all(e[t] >= max(e.values()) for t, e in zip(s.token_ids, entries))

    # ---- embeddings ---------------------------------------------------------------------------
    def embed(
        self,
        texts: str | list[int] | Sequence[str | list[int]],
        pooling: str = "last",
        normalize: bool = True,
        adapter_name: str | None = None,
    ) -> list[torch.Tensor]:
        """One embedding per text (or token-id list), in order: the final norm's output at
        the last token ("last", vLLM's default for a causal LM) or its mean over the tokens
        ("mean"), L2-normalized unless `normalize=False`, float32 [hidden] on the CPU. Texts
        are tokenized as they are (special tokens as the tokenizer adds them, no chat
        template) and run as prompt-only requests batched like any others; with prefix
        caching "last" reuses cached prefixes. Raises ValueError naming the first text that
        fails."""
        single = isinstance(texts, str) or (
            isinstance(texts, list) and bool(texts) and all(isinstance(t, int) for t in texts)
        )
        batch = [texts] if single else list(texts)
        cfg = GenerationConfig(max_new_tokens=0, pooling=pooling)
        responses = new_queue()
        errors: dict[int, str] = {}
        for i, text in enumerate(batch):
            if isinstance(text, str):
                ids = list(self.tokenizer(text)["input_ids"])
            elif isinstance(text, list) and all(isinstance(t, int) for t in text):
                ids = list(text)
            else:
                raise ValueError(f"text {i}: a text or a list of token ids, got {text!r:.80}")
            self._add(ids, cfg, responses, i, adapter_name)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for r in _responses(responses, len(batch)):
            if r.finish_reason == "error":
                errors[r.index] = r.error or "failed"
            elif r.finish_reason is not None:
                v = r.embedding
                out[r.index] = torch.nn.functional.normalize(v, dim=-1) if normalize else v
        if errors:
            first = min(errors)
            raise ValueError(f"text {first} cannot be embedded: {errors[first]}")
        return [v for v in out if v is not None]

    # ---- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline(
    model_path: str | None = None,
    engine_config: EngineConfig | None = None,
    apply_chat_template: bool = True,
) -> Pipeline:
    """Load a model (None: the default SmolLM2-135M-Instruct) and return a Pipeline."""
    return Pipeline(Engine.from_pretrained(model_path, engine_config), apply_chat_template)
