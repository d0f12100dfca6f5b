"""LoRA adapters loaded and unloaded over HTTP (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter), as an operator drives a running server: an adapter loaded while
serving gives the same greedy tokens as the same folder loaded at start, `/v1/models` follows
loads and unloads, an unloaded adapter is 404 while its running request finishes, host copies
beyond `--max-cpu-loras` are dropped and read again with the same tokens, bad folders and
adapters too large for the pool are 400 and the server goes on. The metrics inference gateways
read (vLLM's names) follow the adapters."""

from __future__ import annotations

import threading

import pytest

from tests.test_lora import ADAPTERS, save_adapter
from tests.test_server import (
    AUTH,
    TINY_OPENAI_FLAGS,
    metrics,
    openai_client,
    tiny_server,
    wait_idle,
)

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

PROMPTS = [[17, 410, 93, 1200, 7], [5, 6, 7, 8, 9, 10, 11], [300, 301, 302]]


@pytest.fixture(scope="module")
def folders(tiny_llama_path, tmp_path_factory) -> dict[str, str]:
    """Three rank-4 adapters of different weights, and one of rank 16 (too large for a pool
    sized for rank 4)."""
    root = tmp_path_factory.mktemp("http_adapters")
    qv4 = ADAPTERS["qv4"]
    paths = {
        f"r4_{i}": save_adapter(tiny_llama_path, root / f"r4_{i}", 10 + i, **qv4) for i in range(3)
    }
    paths["r16"] = save_adapter(tiny_llama_path, root / "r16", 20, **ADAPTERS["ko16"])
    return paths


@pytest.fixture(scope="module")
def server(tiny_llama_path, folders):
    """One device slot and one host copy, so that every switch of adapter loads pages and
    reads a folder again; "at_start" is r4_0 loaded from the command line."""
    with tiny_server(
        tiny_llama_path,
        *TINY_OPENAI_FLAGS,
        "--adapters", f"at_start={folders['r4_0']}",
        "--enable-lora-updates",
        "--max-lora-slots", "1",
        "--max-cpu-loras", "1",
    ) as url:  # fmt: skip
        yield url


def post(url: str, path: str, body: dict):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


def load(url: str, name: str, path: str):
    return post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload(url: str, name: str):
    return post(url, "/v1/unload_lora_adapter", {"lora_name": name})


def greedy(url: str, model: str) -> list[str]:
    client = openai_client(url)
    return [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]


def model_ids(url: str) -> set[str]:
    return {m.id for m in openai_client(url).models.list().data}


def test_load_generate_unload_and_models_follow(server, folders):
    base, at_start = greedy(server, "tiny"), greedy(server, "at_start")
    assert base != at_start  # the adapter changes the answers
    r = load(server, "late", folders["r4_0"])
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    assert r.text == "Success: LoRA adapter 'late' added successfully."
    assert model_ids(server) == {"tiny", "at_start", "late"}
    assert greedy(server, "late") == at_start
    r = unload(server, "late")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully."
    assert model_ids(server) == {"tiny", "at_start"}
    r = post(server, "/v1/completions", {"model": "late", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = unload(server, "late")
    assert r.status_code == 404 and "'late' is not loaded" in r.json()["error"]["message"]
    assert greedy(server, "tiny") == base
    assert wait_idle(server)["lmengine_kv_blocks_used"] == 0


def test_host_copies_beyond_the_bound_are_read_again_with_the_same_tokens(server, folders):
    names = ["one", "two"]
    for name, folder in zip(names, (folders["r4_1"], folders["r4_2"])):
        assert load(server, name, folder).status_code == 200
    try:
        first = {name: greedy(server, name) for name in ["at_start", *names]}
        assert len({tuple(v) for v in first.values()}) == 3  # three different adapters
        reads = metrics(server)["lmengine_num_adapter_host_reads"]
        again = {name: greedy(server, name) for name in reversed(["at_start", *names])}
        assert again == first
        m = metrics(server)
        # one slot and one host copy: every switch evicted the pages and read a folder again
        assert m["lmengine_num_adapter_host_reads"] >= reads + 2
        assert m["lmengine_num_host_adapters"] == 1
    finally:
        for name in names:
            assert unload(server, name).status_code == 200


@pytest.mark.parametrize(
    "body, message",
    [
        ({"lora_name": "x", "lora_path": "/no/such/folder"}, "is not a peft adapter folder"),
        ({"lora_name": "at_start", "lora_path": "FOLDER"}, "already loaded"),
        ({"lora_name": "tiny", "lora_path": "FOLDER"}, "is the served model's name"),
        ({"lora_name": "big", "lora_path": "R16"}, "raise max_lora_slots or max_lora_rank"),
        ({"lora_name": "", "lora_path": "FOLDER"}, "lora_name"),
        ({"lora_name": "x"}, "lora_path: Field required"),
    ],
)
def test_bad_loads_are_400_and_the_server_goes_on(server, folders, body, message):
    paths = {"FOLDER": folders["r4_1"], "R16": folders["r16"]}
    body = {k: paths.get(v, v) for k, v in body.items()}
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert model_ids(server) == {"tiny", "at_start"}
    assert len(greedy(server, "at_start")) == len(PROMPTS)


def test_a_running_request_finishes_with_its_unloaded_adapter(server, folders):
    assert load(server, "leaving", folders["r4_1"]).status_code == 200
    reference = openai_client(server).completions.create(
        model="leaving", prompt=PROMPTS[0], max_tokens=400, temperature=0
    )
    pieces, started = [], threading.Event()

    def stream():
        chunks = openai_client(server).completions.create(
            model="leaving", prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True
        )
        for chunk in chunks:
            started.set()
            pieces.append(chunk.choices[0])

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    running = httpx.get(server + "/metrics", headers=AUTH).text
    assert 'running_lora_adapters="leaving"' in running  # what a gateway sees
    assert unload(server, "leaving").status_code == 200
    assert len(pieces) < 300  # unloaded while the request ran
    worker.join(60)
    assert "".join(c.text for c in pieces) == reference.choices[0].text
    assert pieces[-1].finish_reason == reference.choices[0].finish_reason
    assert "leaving" not in model_ids(server)
    assert wait_idle(server)["lmengine_kv_blocks_used"] == 0


def test_gateway_metrics_under_vllm_names(server, folders):
    text = httpx.get(server + "/metrics", headers=AUTH).text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert f"# TYPE {name} gauge" in text and f"\n{name} " in text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="1"' in info[0]
    assert 'running_lora_adapters=""' in info[0]  # idle


def test_endpoints_are_absent_without_the_flag(tiny_llama_path):
    from fastapi.testclient import TestClient

    from lmengine import Engine, EngineConfig
    from lmengine.serve.app import ServerSettings, build_app

    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=32))
    with TestClient(build_app(engine, ServerSettings(model_name="tiny"))) as http:
        body = {"lora_name": "x", "lora_path": "/tmp"}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert "/v1/load_lora_adapter" not in http.get("/openapi.json").json()["paths"]


def test_lora_root_confines_runtime_loads(tiny_llama_path, folders, tmp_path):
    """With --lora-root, a load is refused (403, naming the rule) unless its folder, symlinks
    followed and `..` applied, lies inside the root; the answer is the same for folders that
    do not exist, so it tells nothing of the file system."""
    import os
    import shutil

    from fastapi.testclient import TestClient

    from lmengine import Engine, EngineConfig
    from lmengine.serve.app import ServerSettings, build_app

    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(folders["r4_1"], root / "mine")
    os.symlink(folders["r4_2"], root / "escape")  # inside by name, outside once resolved
    os.symlink(root / "mine", tmp_path / "way_in")  # outside by name, inside once resolved
    settings = ServerSettings(
        model_name="tiny", enable_lora_updates=True, lora_root=os.path.realpath(root)
    )
    engine = Engine.from_pretrained(tiny_llama_path, EngineConfig(num_gpu_blocks=64))
    with TestClient(build_app(engine, settings)) as http:

        def load_from(name: str, path) -> httpx.Response:
            body = {"lora_name": name, "lora_path": str(path)}
            return http.post("/v1/load_lora_adapter", json=body)

        assert load_from("mine", root / "mine").status_code == 200
        assert load_from("via_link", tmp_path / "way_in").status_code == 200
        for path in (
            folders["r4_2"],
            root / "escape",
            root / "mine" / ".." / ".." / "root_sibling",
            tmp_path / "no_such_folder",
        ):
            r = load_from("outside", path)
            assert r.status_code == 403, (path, r.text)
            error = r.json()["error"]
            assert "only from folders inside the server's --lora-root" in error["message"]
            assert error["param"] == "lora_path" and str(tmp_path) not in error["message"]
        missing_inside = load_from("missing", root / "absent")
        assert missing_inside.status_code == 400  # inside: the loader's own answer
        models = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert models == {"tiny", "mine", "via_link"}


def test_lora_root_needs_lora_updates(tmp_path, capsys):
    from lmengine.cli import main

    assert main(["serve", "--lora-root", str(tmp_path)]) == 2
    assert "--lora-root confines runtime adapter loads" in capsys.readouterr().err
