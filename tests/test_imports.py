"""Modules split to break import circles keep their old import paths, and each side imports
first on its own (a circle shows as an ImportError or a half-initialised module there)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest


def test_names_stay_importable_from_where_they_were():
    import lmengine.kernels as kernels
    from lmengine.kernels import attention_metadata, lora_meta, w8a8_checks
    from lmengine.kernels import lora as lora_kernels
    from lmengine.kernels import w8a8 as w8a8_kernels
    from lmengine.kernels.triton import lora as lora_triton
    from lmengine.kernels.triton import paged_attention as attention_triton
    from lmengine.quant import checkpoint, layout
    from lmengine.quant import w8a8 as quant

    # NOTE: the package re-exports the function `paged_attention`, which hides the module
    attention = importlib.import_module("lmengine.kernels.paged_attention")
    assert kernels.AttentionMetadata is attention.AttentionMetadata
    assert attention.AttentionMetadata is attention_metadata.AttentionMetadata
    assert attention_triton.AttentionMetadata is attention_metadata.AttentionMetadata
    assert lora_kernels.LoRAMeta is lora_meta.LoRAMeta is lora_triton.LoRAMeta
    assert w8a8_kernels.check_gemm is w8a8_checks.check_gemm
    for name in ("QUANT_METHOD", "read_quant_config", "build_skeleton", "save_quantized"):
        assert getattr(quant, name) is getattr(checkpoint, name)
    for name in ("W8A8_LAYOUTS", "W8A8Layout", "get_layout"):
        assert getattr(quant, name) is getattr(layout, name)


@pytest.mark.parametrize(
    "module",
    [
        "lmengine.kernels.triton.paged_attention",
        "lmengine.kernels.triton.lora",
        "lmengine.kernels.triton.w8a8",
        "lmengine.quant.checkpoint",
        "lmengine.bench.run",
    ],
)
def test_each_side_of_a_former_circle_imports_first(module):
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"import importlib; importlib.import_module({module!r}); print('ok')"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_loader_reads_a_w8a8_config_without_the_quantizer(tmp_path):
    from lmengine.quant.checkpoint import QUANT_METHOD, read_quant_config

    qc = {"quant_method": QUANT_METHOD, "lm_head": "int8"}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert read_quant_config(tmp_path) == qc
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "gptq"}}')
    assert read_quant_config(tmp_path) is None
    assert read_quant_config(tmp_path / "missing") is None
