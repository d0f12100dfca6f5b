"""schemathesis hooks for fuzzing `lmengine serve` (`SCHEMATHESIS_HOOKS=tests.schemathesis_hooks`):
the generated requests keep their shapes, but the work a valid one asks for is bounded (n,
max_tokens and the interactive turn's length), so that the fuzzing run stays short."""

from __future__ import annotations

import schemathesis

CAPS = {"n": 2, "max_tokens": 4, "max_completion_tokens": 4, "request_output_len": 4,
        "num_beams": 2, "max_output_tokens": 4}  # fmt: skip


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap in CAPS.items():
        value = body.get(key)
        # NOTE: floats too: the server accepts 37.0 as n=37
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if "completions" in case.path and body.get("max_tokens") is None:
        body["max_tokens"] = 4  # none: up to the end of the context
    if case.path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = 4
    if case.path.endswith("interactive_qos"):  # its default output length is long
        body.setdefault("request_output_len", 4)


# What no schema can state, and the server refuses with a 400 saying so: a prompt longer than
# the context in tokens, a JSON schema, regex or grammar that does not compile or that asks
# for text the tokenizer cannot write, a named tool_choice that is none of the tools, a prompt
# the tokenizer turns into no tokens, more prompts x n than one request may ask for (a product
# of two fields), a LoRA folder that cannot be loaded or a name already taken.
SEMANTIC_REFUSALS = (
    "context_length_exceeded",
    "this model's context is",  # the same, in Anthropic's body (no code)
    "exceeds the model's context length",
    "empty prompt",
    "does not compile",
    "no token of the model",
    "names an unknown function",
    "prompts x n per request",
    "cannot load the adapter",
    "is the served model's name",
)


@schemathesis.check
def valid_data_accepted(ctx, response, case) -> None:
    """schemathesis' positive_data_acceptance, except for the refusals above: a request the
    document calls valid is never refused for anything else."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    if response.status_code >= 400 and response.status_code not in (401, 404, 429):
        text = response.text
        if response.status_code == 400 and any(reason in text for reason in SEMANTIC_REFUSALS):
            return
        raise AssertionError(f"valid data refused with {response.status_code}: {text[:300]}")
