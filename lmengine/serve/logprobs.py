"""Logprobs in OpenAI's two shapes: chat (`logprobs.content`, one entry per token with its
top alternatives and bytes) and legacy completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`). Token texts are decoded once per token id and cached."""

from __future__ import annotations

from lmengine.engine.request import Response

MIN_LOGPROB = -9999.0  # NOTE: JSON has no -inf; OpenAI and vLLM clamp the same way


class TokenTexts:
    """The text of single token ids (decoded once, then cached); never decodes sequences."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(dist: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(dist.items(), key=lambda kv: -kv[1])[:num_top]


def chat_logprobs(resp: Response, start: int, num_top: int, token_text: TokenTexts) -> list[dict]:
    """`logprobs.content` entries of the tokens from `start` on."""
    out = []
    for tok, dist in zip(resp.token_ids[start:], (resp.logprobs or [])[start:]):
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
    resp: Response, start: int, num_top: int, offset: int, token_text: TokenTexts
) -> tuple[dict, int]:
    """The legacy `logprobs` object of the tokens from `start` on, whose text starts at
    character `offset` of the choice; also returns the offset after them."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, dist in zip(resp.token_ids[start:], (resp.logprobs or [])[start:]):
        text = token_text(tok)
        tokens.append(text)
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
