"""LoRA on the linears of a patched model, without touching any model's forward.

After patching, every linear inside a decoder layer is a `PackedLinear` or a `MergedLinear` (or
the `GGUFLinear` that replaced one: float32 adapters on top of a GGUF file's blocks).
`find_lora_targets` maps each HF linear name (`model.layers.3.self_attn.q_proj`) to its
patched module and the slice of its output (`q_proj` is a part of `qkv_proj`); `enable_lora`
turns one module into its LoRA subclass, which adds the per-token adapter deltas of the
step (`StepContext.lora`) to the base output. A module kind (`self_attn.qkv_proj`) is the
module's path inside its layer; all layers of a kind share one page numbering.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from lmengine.kernels.lora import LoRAMeta, lora_add
from lmengine.models.context import get_step_context
from lmengine.models.layers import GGUFLinear, PackedLinear

_LAYER_RE = re.compile(r"^(?P<prefix>.*\.layers)\.(?P<layer>\d+)\.(?P<kind>.+)$")


@dataclass
class LoRAStep:
    """The LoRA part of one step's context: how tokens group by adapter, and per kind the
    page table [num_step_adapters, max_pages] of the step's adapters (absent: no adapter of
    this step targets the kind)."""

    meta: LoRAMeta
    page_tables: dict[str, torch.Tensor]


@dataclass
class LoRAKind:
    """One kind of LoRA-able linear: its shape, its parts (HF linears) and its modules."""

    name: str  # path inside a layer, e.g. "self_attn.qkv_proj"
    in_features: int
    part_names: list[str]  # HF linear names of the parts, e.g. ["q_proj", "k_proj", "v_proj"]
    part_sizes: list[int]  # output rows of each part
    modules: dict[int, PackedLinear] = field(default_factory=dict)  # layer -> module

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)

    def part_offset(self, part: int) -> int:
        return sum(self.part_sizes[:part])


@dataclass
class LoRATargets:
    """Every LoRA-able linear of a patched model."""

    kinds: dict[str, LoRAKind]
    by_hf_name: dict[str, tuple[str, int, int]]  # HF module name -> (kind, layer, part)

    def describe(self) -> str:
        names = sorted({p for k in self.kinds.values() for p in k.part_names})
        return ", ".join(names)


def find_lora_targets(model: nn.Module) -> LoRATargets:
    """Scan a patched model for linears inside decoder layers (not lm_head, not embeddings)."""
    kinds: dict[str, LoRAKind] = {}
    by_hf_name: dict[str, tuple[str, int, int]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (PackedLinear, GGUFLinear)):
            continue
        match = _LAYER_RE.match(name)
        if match is None:
            continue
        layer, kind_name = int(match["layer"]), match["kind"]
        parent = name.rpartition(".")[0]
        if getattr(module, "source_names", None):  # a MergedLinear (or its GGUFLinear)
            part_names, part_sizes = list(module.source_names), list(module.output_sizes)
        else:
            part_names, part_sizes = [name.rpartition(".")[2]], [module.out_features]
        kind = kinds.setdefault(
            kind_name, LoRAKind(kind_name, module.in_features, part_names, part_sizes)
        )
        if (kind.in_features, kind.part_sizes) != (module.in_features, part_sizes):
            raise ValueError(f"LoRA: layers differ in the shape of {kind_name}; not supported")
        kind.modules[layer] = module
        for part, part_name in enumerate(part_names):
            by_hf_name[f"{parent}.{part_name}"] = (kind_name, layer, part)
    return LoRATargets(kinds, by_hf_name)


class LoRALinearMixin:
    """Adds `scale * B(A(x))` per token to a linear's output, for the step's adapters.

    `lora_a` [num_pages + 1, in], `lora_b` [num_pages + 1, out] and `lora_scale`
    [num_pages + 1] are this module's pages of the pool; the last page stays zero (padding).
    `lora_cols` [num_pages + 1, 2]: the output columns [begin, end) of each page's part.
    """

    lora_kind: str
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_scale: torch.Tensor | None = None
    lora_cols: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # [num_tokens, out]
        lora = get_step_context().lora
        if lora is None:
            return out
        table = lora.page_tables.get(self.lora_kind)
        if table is None:
            return out
        return lora_add(
            out, x, self.lora_a, self.lora_b, self.lora_scale, table, lora.meta, self.lora_cols
        )


_LORA_CLASSES: dict[type, type] = {}


def enable_lora(module: PackedLinear | GGUFLinear, kind: str, num_pages: int) -> None:
    """Turn `module` into its LoRA subclass in place, with an all-zero pool of `num_pages`."""
    cls = type(module)
    if not issubclass(cls, LoRALinearMixin):
        if cls not in _LORA_CLASSES:
            _LORA_CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRALinearMixin, cls), {})
        module.__class__ = _LORA_CLASSES[cls]
    # float32 pages on the blocks of a GGUFLinear, else in the weight's dtype
    if isinstance(module, PackedLinear):
        like = module.weight
    else:
        like = torch.empty(0, device=module.blocks0.device)
    module.lora_kind = kind
    # [num_pages + 1, in], [num_pages + 1, out], [num_pages + 1]: the last page is padding
    module.lora_a = like.new_zeros(num_pages + 1, module.in_features)
    module.lora_b = like.new_zeros(num_pages + 1, module.out_features)
    module.lora_scale = like.new_zeros(num_pages + 1)
    module.lora_cols = torch.tensor([[0, module.out_features]] * (num_pages + 1))
