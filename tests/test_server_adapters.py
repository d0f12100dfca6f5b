"""/v1/models lists the LoRA adapters the engine serves now: an app over a tiny Llama started
with one adapter, then `engine.add_adapter` and `engine.remove_adapter` while it serves; a
request naming a removed adapter is a 404, one naming an added adapter is served."""

from __future__ import annotations

import threading
import time

import pytest

from lmengine import Engine, EngineConfig
from tests.test_lora import ADAPTERS, save_adapter
from tests.test_server import free_port, httpx

MODEL = "tiny"


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_adapters")
    return {
        name: save_adapter(tiny_llama_path, root / name, seed=i, **ADAPTERS[name])
        for i, name in enumerate(("qv4", "ko16"))
    }


@pytest.fixture()
def served(tiny_llama_path, adapters):
    """(engine, base url) of `build_app` under uvicorn in a thread of this process."""
    import uvicorn

    from lmengine.serve.app import ServerSettings, build_app

    config = EngineConfig(
        adapters={"qv4": adapters["qv4"]},
        max_lora_rank=16,  # NOTE: room for ko16, added later
        num_gpu_blocks=64,
        block_size=4,
        num_threads=1,
    )
    engine = Engine.from_pretrained(tiny_llama_path, config)
    app = build_app(engine, ServerSettings(model_name=MODEL))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        engine.close()  # NOTE: the app's shutdown closed it already; closing twice is fine


def listed(url: str) -> list[tuple[str, str | None]]:
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 200, r.text
    return [(m["id"], m["parent"]) for m in r.json()["data"]]


def complete(url: str, model: str):
    body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_models_follow_adapters_added_and_removed(served, adapters):
    engine, url = served
    assert listed(url) == [(MODEL, None), ("qv4", MODEL)]

    engine.add_adapter("ko16", adapters["ko16"])
    assert listed(url) == [(MODEL, None), ("ko16", MODEL), ("qv4", MODEL)]
    r = complete(url, "ko16")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ko16" and r.json()["usage"]["completion_tokens"] == 2

    engine.remove_adapter("qv4")
    assert listed(url) == [(MODEL, None), ("ko16", MODEL)]
    r = complete(url, "qv4")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"

    engine.remove_adapter("ko16")
    assert listed(url) == [(MODEL, None)]
    assert complete(url, "ko16").status_code == 404
    assert complete(url, MODEL).status_code == 200
