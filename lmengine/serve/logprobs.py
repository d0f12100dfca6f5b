"""Logprobs in OpenAI's two shapes: chat (`logprobs.content`, one entry per token with its
top alternatives and bytes) and legacy completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`). Token texts are decoded once per token id and cached."""

from __future__ import annotations

from lmengine.engine.request import Response

MIN_LOGPROB = -9999.0  # NOTE: JSON has no -inf; OpenAI and vLLM clamp the same way


class TokenTexts:
    """The text of single token ids (decoded once, then cached); never decodes sequences.
    Bounded by the vocabulary: one entry per token id the model can emit."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def __len__(self) -> int:
        return len(self._texts)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(dist: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(dist.items(), key=lambda kv: -kv[1])[:num_top]


def chat_logprobs(resp: Response, num_top: int, token_text: TokenTexts) -> list[dict]:
    """`logprobs.content` entries of the response's tokens."""
    out = []
    for tok, dist in zip(resp.token_ids, resp.logprobs or []):
        text = token_text(tok)
        out.append(
            {
                "token": text,
                "logprob": _clamp(dist.get(tok, MIN_LOGPROB)),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": token_text(t),
                        "logprob": _clamp(lp),
                        "bytes": list(token_text(t).encode("utf-8")),
                    }
                    for t, lp in _top(dist, num_top)
                ],
            }
        )
    return out


def completion_logprobs(
    resp: Response, num_top: int, offset: int, token_text: TokenTexts
) -> tuple[dict, int]:
    """The legacy `logprobs` object of the response's tokens, whose text starts at character
    `offset` of the choice; also returns the offset after them."""
    pairs = zip(resp.token_ids, resp.logprobs or [])
    return legacy_logprobs(pairs, num_top, offset, token_text)


def echo_logprobs(
    prompt_ids: list[int], resp: Response, num_top: int, token_text: TokenTexts
) -> tuple[dict, int]:
    """The legacy `logprobs` object of an echoed prompt (OpenAI: `null` for the first token,
    which nothing predicts), from character 0 on; also returns the offset after it."""
    return legacy_logprobs(zip(prompt_ids, resp.prompt_logprobs or []), num_top, 0, token_text)


def legacy_logprobs(pairs, num_top: int, offset: int, token_text: TokenTexts) -> tuple[dict, int]:
    """OpenAI's legacy `logprobs` object of (token id, {token_id: logprob} or None) pairs,
    the first token's text at character `offset`; also returns the offset after them."""
    tokens: list[str] = []
    token_lps: list[float | None] = []  # None: the first prompt token, which nothing predicts
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tok, dist in pairs:
        text = token_text(tok)
        tokens.append(text)
        if dist is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_clamp(dist.get(tok, MIN_LOGPROB)))
            tops.append({token_text(t): _clamp(lp) for t, lp in _top(dist, num_top)})
        offsets.append(offset)
        offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, offset


def join_legacy(first: dict, second: dict) -> dict:
    """Two legacy `logprobs` objects one after the other (an echoed prompt, its completion)."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(
    prompt_ids: list[int], resp: Response, num_top: int, token_text: TokenTexts
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token_id: {logprob,
    rank, decoded_token}} holding the prompt token and the top `num_top` (rank 1 = the most
    likely; None for a prompt token outside the top N, whose rank is not computed)."""
    out: list[dict | None] = []
    for tok, dist in zip(prompt_ids, resp.prompt_logprobs or []):
        if dist is None:
            out.append(None)
            continue
        top = _top(dist, num_top)
        rank = {t: r for r, (t, _) in enumerate(top, 1)}
        entries = {t: lp for t, lp in top}
        entries.setdefault(tok, dist.get(tok, MIN_LOGPROB))
        out.append(
            {
                str(t): {"logprob": _clamp(lp), "rank": rank.get(t), "decoded_token": token_text(t)}
                for t, lp in entries.items()
            }
        )
    return out
