"""Structured outputs (xgrammar) with the tiny random model, the hardest case: unconstrained
it emits noise, so every valid output is the grammar's doing. Over many seeds, sampled and
greedy, batched with unconstrained requests, under chunked prefill and preemption: JSON that
validates against a schema, strings that fully match a regex, one of the choices, sentences
of an EBNF grammar, xgrammar structural tags. Bad specs fail only their request."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from lmengine import Engine, EngineConfig, GenerationConfig
from tests.engine_utils import random_prompts, run_threads
from tests.hf_reference import hf_greedy


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=150)  # bounded like every field: sampled outputs always end
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    address: Address
    nickname: str | None = Field(default=None, max_length=8)


REGEX = r"[A-Z]{2}-\d{3,4}(\.[a-z]{1,5})?"
CHOICES = ["red", "green", "blue", "light blue"]
GRAMMAR = """
root ::= greeting " " name "!"
greeting ::= "hello" | "hi" | "good " ("morning" | "evening")
name ::= [A-Z] [a-z] [a-z]? [a-z]?
"""
GRAMMAR_RE = r"(hello|hi|good (morning|evening)) [A-Z][a-z]{1,3}!"
# xgrammar's structural tag: fixed text, then a tagged JSON object (at most one whitespace
# character in a row), then the end
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "Answer: "},
            {
                "type": "tag",
                "begin": "<address>",
                "content": {
                    "type": "json_schema",
                    "json_schema": Address.model_json_schema(),
                    "max_whitespace_cnt": 1,
                },
                "end": "</address>",
            },
        ],
    },
}


def _check_tag(text: str):
    found = re.fullmatch(r"Answer: <address>(.*)</address>", text, re.DOTALL) or _fail(text)
    Address.model_validate_json(found.group(1))


SPECS = {
    "json": ({"json": Person.model_json_schema()}, lambda t: Person.model_validate_json(t)),
    "regex": ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or _fail(t)),
    "choice": ({"choice": CHOICES}, lambda t: t in CHOICES or _fail(t)),
    "grammar": ({"grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t) or _fail(t)),
    "structural_tag": ({"structural_tag": TAG}, _check_tag),
}


def _fail(text: str):
    raise AssertionError(f"invalid output {text!r}")


@pytest.mark.parametrize(
    "engine_cfg",
    [
        dict(block_size=4, num_gpu_blocks=1024),
        dict(block_size=4, num_gpu_blocks=48, max_prefill_token_num=7),  # chunks, preempts
    ],
    ids=["batched", "chunked_preempted"],
)
def test_every_output_is_valid_over_many_seeds(tiny_llama_path, engine_cfg):
    num_seeds = 16
    prompts, configs, checks = [], [], []
    for k, (name, (spec, check)) in enumerate(SPECS.items()):
        for seed in range(num_seeds):
            greedy = seed == 0
            prompts.append(random_prompts([5 + seed], 49152, seed=100 * k + seed)[0])
            configs.append(
                GenerationConfig(
                    max_new_tokens=160,
                    do_sample=not greedy,
                    temperature=1.2,
                    random_seed=seed,
                    structured_outputs=spec,
                )
            )
            checks.append((name, check))
    plain = random_prompts([9, 14, 21], 49152, seed=7)  # unconstrained batch-mates
    prompts += plain
    configs += [GenerationConfig(max_new_tokens=12)] * len(plain)
    with Engine.from_pretrained(tiny_llama_path, EngineConfig(**engine_cfg)) as engine:
        # together: a small pool must fill in the first step (preemption by design)
        together = engine_cfg["num_gpu_blocks"] < 100
        results = run_threads(engine, prompts, configs, num_threads=8, together=together)
        engine.check_integrity()
        stats = engine.stats()
    if engine_cfg["num_gpu_blocks"] < 100:
        assert stats["num_preemptions"] > 0
    for (name, check), r in zip(checks, results):
        assert r.finish_reason == "stop", (name, r.finish_reason, r.text, r.error)
        check(r.text)
    for r, want in zip(results[len(checks) :], hf_greedy(tiny_llama_path, plain, 12)):
        assert r.token_ids == want  # the masks touch only the constrained rows


def test_json_object_is_an_object(smollm2_path):
    from lmengine.api import chat_token_ids

    with Engine.from_pretrained(smollm2_path, EngineConfig(num_gpu_blocks=128)) as engine:
        ids = chat_token_ids(
            engine.tokenizer,
            [{"role": "user", "content": "Describe a cat as JSON with a name and an age."}],
        )
        cfg = GenerationConfig(max_new_tokens=96, structured_outputs={"json_object": True})
        r = engine.create_instance().infer(0, ids, gen_config=cfg)
    assert r.finish_reason == "stop", r.text
    assert isinstance(json.loads(r.text), dict)


BAD = {
    "unknown type": ({"json": {"type": "objectx"}}, 'Unsupported type "objectx"'),
    "schema not JSON": ({"json": "{not json"}, "does not compile"),
    "regex": ({"regex": "(ab"}, "The parenthesis is not closed"),
    "grammar": ({"grammar": "root ::= "}, "EBNF parser error"),
    "structural tag": ({"structural_tag": {"type": "structural_tag"}}, "does not compile"),
}


def test_bad_specs_fail_their_request_only(tiny_llama_path):
    prompts = random_prompts([6] * (2 * len(BAD)), 49152, seed=3)
    configs = []
    for spec, _ in BAD.values():
        configs += [
            GenerationConfig(max_new_tokens=4, structured_outputs=spec),
            GenerationConfig(max_new_tokens=4, structured_outputs={"choice": ["x", "y"]}),
        ]
    with Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=256)) as engine:
        results = run_threads(engine, prompts, configs, stagger_s=0.0)
        engine.check_integrity()
    for (name, (_, message)), bad, good in zip(BAD.items(), results[::2], results[1::2]):
        assert bad.finish_reason == "error" and message in bad.error, (name, bad.error)
        assert good.text in ("x", "y"), name


def test_config_checks_the_shape_of_structured_outputs():
    for spec, message in [
        ({}, "exactly one of"),
        ({"json": {}, "regex": "a"}, "exactly one of"),
        ({"jsonn": {}}, "exactly one of"),
        ({"choice": []}, "non-empty list"),
        ({"json_object": 1}, "must be True"),
        ({"regex": ""}, "non-empty regex"),
        ({"structural_tag": 1}, "structural tag"),
    ]:
        with pytest.raises(ValueError, match=message):
            GenerationConfig(structured_outputs=spec)
    with pytest.raises(ValueError, match="ignore_eos"):
        GenerationConfig(structured_outputs={"regex": "a"}, ignore_eos=True)
    with pytest.raises(ValueError, match="beam search does not support structured_outputs"):
        GenerationConfig(num_beams=2, structured_outputs={"regex": "a"})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_outputs_valid_and_greedy_equal(tiny_llama_path, method):
    """Drafts that break the grammar are rejected, never emitted: greedy constrained outputs
    equal those without speculation, sampled ones are valid, and drafts were accepted."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["draft_model"] = tiny_llama_path  # unconstrained: it drafts invalid tokens too
    prompts, configs, checks = [], [], []
    for k, (name, (constraint, check)) in enumerate(SPECS.items()):
        for seed in range(4):
            prompt = random_prompts([6], 49152, seed=50 * k + seed)[0]
            prompts.append(prompt * 3)  # repeats that prompt lookup finds
            configs.append(
                GenerationConfig(
                    max_new_tokens=160,
                    do_sample=seed > 0,
                    random_seed=seed,
                    structured_outputs=constraint,
                )
            )
            checks.append((name, check))
    cfg = dict(block_size=4, num_gpu_blocks=1024)
    with Engine.from_pretrained(tiny_llama_path, EngineConfig(**cfg)) as engine:
        plain = run_threads(engine, prompts, configs, stagger_s=0.0)
    with Engine.from_pretrained(tiny_llama_path, EngineConfig(**cfg, speculative=spec)) as engine:
        fast = run_threads(engine, prompts, configs, stagger_s=0.0)
        stats = engine.stats()["speculative"]
        engine.check_integrity()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats  # some refused
    for (name, check), c, a, b in zip(checks, configs, plain, fast):
        assert b.finish_reason == "stop", (name, b.text, b.error)
        check(b.text)
        if not c.do_sample:
            assert b.token_ids == a.token_ids, name
