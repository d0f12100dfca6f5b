"""The supported-models table of the README, generated from MODULE_MAP.

`python -m lmengine.models.supported` prints it; tests/test_models_registry.py checks that the
README holds exactly this text. One row per `*ForCausalLM` (or `*LMHeadModel`) key; the notes
are the first paragraph of the patched class's docstring.
"""

from __future__ import annotations

import inspect

from lmengine.models.module_map import MODULE_MAP
from lmengine.models.patch import _import

TESTED_TRANSFORMERS = "5.23"  # the version the parity tests ran against (setup.py pins it)


def supported_models_markdown(module_map: dict[str, str] | None = None) -> str:
    module_map = MODULE_MAP if module_map is None else module_map
    lines = [
        f"Tested with transformers {TESTED_TRANSFORMERS}, each architecture by an HF-parity "
        "test (tests/test_models_parity.py, tests/test_hf_parity.py).",
        "",
        "| architecture | transformers module | lmengine patch | what the patch handles |",
        "| --- | --- | --- | --- |",
    ]
    heads = [k for k in module_map if k.endswith(("ForCausalLM", "LMHeadModel"))]
    for hf_name in sorted(heads, key=lambda n: n.rpartition(".")[2].lower()):
        target = module_map[hf_name]
        cls = _import(target)
        doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "").split("\n\n")[0]
        module, _, arch = hf_name.rpartition(".")
        patch_module = target.rpartition(".")[0]
        lines.append(f"| `{arch}` | `{module}` | `{patch_module}` | {' '.join(doc.split())} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(supported_models_markdown(), end="")
