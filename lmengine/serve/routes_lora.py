"""LoRA adapters loaded and unloaded while serving, with vLLM's paths and bodies:
POST /v1/load_lora_adapter {lora_name, lora_path}, POST /v1/unload_lora_adapter {lora_name}.
Behind the API keys, and only with `--enable-lora-updates` (vLLM gates them the same way);
with `--lora-root DIR` a load is refused (403) unless its folder, symlinks followed, lies inside
DIR. A loaded adapter is a model: `/v1/models` lists it and requests name it in `model`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from lmengine.flags import one_line
from lmengine.serve.auth import api_key_check
from lmengine.serve.client import ServerContext
from lmengine.serve.errors import APIError, error_responses
from lmengine.serve.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def lora_router(client: ServerContext) -> APIRouter:
    """The two adapter endpoints over `client`'s engine, behind the API keys."""
    router = APIRouter(
        dependencies=[Depends(api_key_check(client.settings.api_keys))], tags=["adapters"]
    )
    engine = client.engine

    @router.post(
        "/v1/load_lora_adapter",
        response_class=PlainTextResponse,
        responses=error_responses(400, 401, 403, 413, 503),
    )
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name = body.lora_name
        if name == client.settings.model_name:
            raise APIError(400, f"{name!r} is the served model's name: give the adapter another")
        root = client.settings.lora_root
        if root is not None and not inside(body.lora_path, root):
            # NOTE: the answer is the same whether the folder exists or not
            raise APIError(
                403,
                "adapters load only from folders inside the server's --lora-root, symlinks "
                "followed; lora_path is not inside it",
                type_="permission_error",
                param="lora_path",
            )
        client.check_engine()
        try:  # NOTE: read from disk in a worker thread; the engine steps meanwhile
            await asyncio.to_thread(engine.add_adapter, name, body.lora_path)
        except Exception as e:
            client.check_engine()
            raise APIError(400, f"cannot load the adapter {name!r}: {one_line(e)}") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    @router.post(
        "/v1/unload_lora_adapter",
        response_class=PlainTextResponse,
        responses=error_responses(400, 401, 404, 413, 503),
    )
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        name = body.lora_name
        client.check_engine()
        try:
            await asyncio.to_thread(engine.remove_adapter, name)
        except ValueError:  # the engine's "unknown adapter": never loaded, or unloaded already
            raise APIError(404, f"the adapter {name!r} is not loaded", code="not_found") from None
        return f"Success: LoRA adapter '{name}' removed successfully."

    return router


def inside(path: str, root: str) -> bool:
    """Whether `path`, resolved (symlinks followed, `..` applied), lies inside the resolved
    folder `root`."""
    try:
        return Path(path).resolve().is_relative_to(root)
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return False
