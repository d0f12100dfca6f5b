"""The tokenizer router, with vLLM's paths and shapes: POST /tokenize, POST /detokenize,
GET /tokenizer_info. Clients that score text (lm-evaluation-harness' `local-completions`)
tokenize through the server with them, so their token ids are the engine's own."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from lmengine.serve.auth import api_key_check
from lmengine.serve.client import ServerContext
from lmengine.serve.errors import APIError, error_responses
from lmengine.serve.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from lmengine.serve.tools import chat_messages, template_takes_tools


def _token_str(token) -> str | None:
    return None if token is None else str(token)


def tokenizer_router(client: ServerContext) -> APIRouter:
    """/tokenize, /detokenize and /tokenizer_info over the served tokenizer, behind the keys."""
    router = APIRouter(dependencies=[Depends(api_key_check(client.settings.api_keys))])
    tokenizer = client.tokenizer

    @router.post("/tokenize", responses=error_responses(400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest):
        client.adapter_for(body.model)  # 404 for an unknown model, as the other endpoints
        if isinstance(body, TokenizeChatRequest):  # the same messages as a chat request's
            native = template_takes_tools(tokenizer, client.settings.chat_template)
            messages = chat_messages(body.messages, native)
            ids = await client.off_loop(client.encode_chat, messages, body.add_generation_prompt)
        else:
            ids = await client.off_loop(client.encode_text, body.prompt, body.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": client.session_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @router.post("/detokenize", responses=error_responses(400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest):
        client.adapter_for(body.model)
        vocab = client.engine.info.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    @router.get("/tokenizer_info", responses=error_responses(401))
    async def tokenizer_info():
        template = client.settings.chat_template or getattr(tokenizer, "chat_template", None)
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "model_max_length": client.session_len,
            "vocab_size": client.engine.info.vocab_size,
            "bos_token": _token_str(tokenizer.bos_token),
            "eos_token": _token_str(tokenizer.eos_token),
            "pad_token": _token_str(tokenizer.pad_token),
            "unk_token": _token_str(tokenizer.unk_token),
            "chat_template": template if isinstance(template, str) else None,
        }

    return router
