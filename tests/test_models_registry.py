"""MODULE_MAP bookkeeping: the README table is generated from it, every architecture in it
has a parity test, every target subclasses its HF class, unsupported architectures are a
clear error, and the guide's example (a user patch from outside the package) runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lmengine import EngineConfig
from lmengine.models import MODULE_MAP, patch, supported_architectures
from lmengine.models.patch import _import
from lmengine.models.supported import supported_models_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_is_generated_from_module_map():
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- models-table:start -->\n", "<!-- models-table:end -->"
    assert start in readme and end in readme
    block = readme.split(start, 1)[1].split(end, 1)[0]
    assert block == supported_models_markdown(), (
        "README's supported-models table is stale: paste `python -m lmengine.models.supported`"
    )
    for arch in supported_architectures():
        assert f"`{arch}`" in block


def test_every_architecture_has_a_parity_test():
    from tests.test_models_parity import ARCHITECTURES

    tested = {model_cls for _, model_cls, _ in ARCHITECTURES.values()} | {"LlamaForCausalLM"}
    assert set(supported_architectures()) <= tested


@pytest.mark.parametrize("hf_name", sorted(MODULE_MAP))
def test_every_target_subclasses_its_hf_class(hf_name):
    assert issubclass(_import(MODULE_MAP[hf_name]), _import(hf_name))


def test_unsupported_architecture_error_lists_supported_and_the_guide():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(ValueError) as err:
        patch(model)
    message = str(err.value)
    for arch in supported_architectures():
        assert arch in message
    assert "register_module" in message and "module_map" in message
    assert "docs/adding_a_model.md" in message and (ROOT / "docs/adding_a_model.md").exists()


@pytest.mark.parametrize(
    "value", [{"a": 1}, ["transformers.X"], "transformers.X", {1: "lmengine.Y"}]
)
def test_engine_config_module_map_must_map_names_to_names(value):
    with pytest.raises(ValueError, match="module_map"):
        EngineConfig(module_map=value)


@pytest.fixture()
def example_module():
    name = "new_model_patch_example"
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples/new_model_patch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # patch() imports the patched classes by qualified name
    spec.loader.exec_module(module)
    before = dict(MODULE_MAP)
    yield module
    MODULE_MAP.clear()
    MODULE_MAP.update(before)
    del sys.modules[name]


@pytest.mark.parametrize("argv", [[], ["--register"]], ids=["engine_config", "register"])
def test_guide_example_runs_and_matches_transformers(example_module, argv, capsys):
    assert example_module.main(argv) == 0
    out = capsys.readouterr().out
    assert "Exaone4ForCausalLM has no lmengine patch" in out
    assert "greedy output equals transformers: True" in out
    if argv:
        assert "transformers.models.exaone4.modeling_exaone4.Exaone4ForCausalLM" in MODULE_MAP
    else:
        assert not any("exaone4" in k for k in MODULE_MAP), "module_map leaked into MODULE_MAP"


@pytest.mark.parametrize("arch", ["opt", "gpt_neox", "qwen2"])
def test_w8a8_on_an_architecture_without_a_layout_is_a_clear_error(arch, tmp_path, smollm2_path):
    """Patches that subclass the Llama patches must not pass for Llama in w8a8's layout
    lookup (they used to fail later with an AttributeError)."""
    from lmengine import Engine
    from tests.test_models_parity import save_tiny_model

    path = save_tiny_model(tmp_path / arch, smollm2_path, arch)
    with pytest.raises(ValueError, match=r"w8a8 quantization is not supported.*supported: Llama"):
        Engine.from_pretrained(path, EngineConfig(quant_policy="w8a8", num_gpu_blocks=8))
