"""Request bodies -> engine inputs: chat message text, stop strings and one GenerationConfig
per choice. Every bad value becomes an `APIError(400)` naming it; nothing here talks to the
engine."""

from __future__ import annotations

from lmengine.config import GenerationConfig
from lmengine.serve.errors import APIError
from lmengine.serve.protocol import ChatMessage, InteractiveRequestQos


def text_of(message: ChatMessage) -> str:
    """The text of a chat message (its text parts joined)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def assistant_turn(text: str, calls: list[tuple[str, str, str]]) -> dict:
    """An earlier assistant turn as a chat message: its `text` and its tool `calls` (id,
    function name, arguments as JSON text); a turn of calls alone has no content."""
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, name, arguments in calls
        ]
    return message


def stop_words(stop: str | list[str] | None) -> list[str] | None:
    """OpenAI's `stop` (a string or a list) as the engine's list; None when empty."""
    words = [stop] if isinstance(stop, str) else list(stop or [])  # at most 16: StopStrings
    return [w for w in words if w] or None


def structured_outputs(body) -> dict | None:
    """The engine's `structured_outputs` spec of a request body: from `response_format`,
    a `guided_*` field or vLLM's `structured_outputs`; 400 when it names more than one."""
    specs = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        specs.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        specs.append(("response_format", {"json": fmt.json_schema.schema_}))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(body, field)
        if value is not None:
            specs.append((field, {kind: value}))
    if body.structured_outputs is not None:
        given = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        specs.append(("structured_outputs", given))
    if len(specs) > 1:
        names = ", ".join(name for name, _ in specs)
        raise APIError(400, f"give one output constraint, got {names}", param=specs[1][0])
    return specs[0][1] if specs else None


def gen_configs(
    body,
    num_prompts: int,
    max_tokens: int | None,
    logprobs: int | None,
    session_len: int,
    prompt_logprobs: int | None = None,
) -> list[GenerationConfig]:
    """One GenerationConfig per choice (prompt-major: prompt i, choice j -> i * n + j).
    `max_tokens` None: up to the context length; 0: the prompt only (scoring)."""
    if max_tokens is not None and max_tokens > session_len:
        raise APIError(
            400,
            f"max_tokens={max_tokens} exceeds the model's context length of {session_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    beam = {}
    if body.num_beams > 1:  # NOTE: one beam search per choice would repeat the same search
        if body.n > 1:
            raise APIError(400, "num_beams > 1 needs n == 1", param="n")
        beam = dict(
            num_beams=body.num_beams,
            length_penalty=body.length_penalty,
            early_stopping=body.early_stopping,
        )
    constraint = structured_outputs(body)
    configs = []
    for _ in range(num_prompts):
        for j in range(body.n):
            seed = body.seed
            if seed is not None:
                seed = (seed + j) % 2**63  # NOTE: n choices with one seed must still differ
            try:
                cfg = GenerationConfig(
                    max_new_tokens=session_len if max_tokens is None else max_tokens,
                    # at least min_tokens, unless max_tokens ends the answer first
                    min_new_tokens=min(
                        body.min_tokens, session_len if max_tokens is None else max_tokens
                    ),
                    do_sample=body.temperature > 0 and not beam,
                    temperature=body.temperature if body.temperature > 0 else 1.0,
                    top_k=max(body.top_k, 0),
                    top_p=body.top_p,
                    repetition_penalty=body.repetition_penalty,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    stop_words=stop_words(body.stop),
                    stop_token_ids=body.stop_token_ids,
                    ignore_eos=body.ignore_eos,
                    random_seed=seed,
                    logprobs=logprobs,
                    skip_special_tokens=body.skip_special_tokens,
                    prompt_logprobs=prompt_logprobs,
                    structured_outputs=constraint,
                    **beam,
                )
            except ValueError as e:
                raise APIError(400, str(e)) from None
            configs.append(cfg)
    return configs


def interactive_gen_config(body: InteractiveRequestQos, max_tokens: int) -> GenerationConfig:
    """The GenerationConfig of one interactive QoS turn (LMDeploy's field names)."""
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=body.temperature > 0,
            temperature=body.temperature if body.temperature > 0 else 1.0,
            top_k=max(body.top_k, 0),
            top_p=body.top_p,
            repetition_penalty=body.repetition_penalty,
            ignore_eos=body.ignore_eos,
            random_seed=body.seed,
            stop_words=stop_words(body.stop),
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None
