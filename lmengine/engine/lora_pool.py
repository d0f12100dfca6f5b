"""The LoRA pool: adapters' weights in host memory, and their pages on the device.

`read_peft_adapter` reads a peft LoRA folder (`adapter_config.json` and
`adapter_model.safetensors`) and checks it against the base model's linears, naming any
mismatch. The LoRAPool keeps every added adapter's weights on the host and, when the
AdapterManager gives an adapter pages, copies them into the device pool of each linear.

Page layout: within a linear of a layer, an adapter's pages hold the rows of A (and of B^T,
in its part's columns) of each part in order (q, then k, then v for `qkv_proj`), each row
with its part's scale (`lora_alpha / r`, or `/ sqrt(r)` with rslora). Unused pages of the
adapter stay zero.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmengine.kernels.lora import LoRAMeta
from lmengine.models.lora import LoRAStep, LoRATargets, enable_lora, find_lora_targets
from lmengine.scheduler.adapter_manager import AdapterPlan

_KEY_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(\.[^.]+)?\.weight$")
_PREFIX = "base_model.model."
DEFAULT_MAX_LORA_RANK = 16


@dataclass
class LoRAPart:
    part: int  # index of the HF linear within its kind's module
    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out_part, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class AdapterWeights:
    """One adapter in host memory, by kind and layer."""

    path: str
    parts: dict[str, dict[int, list[LoRAPart]]] = field(default_factory=dict)

    @property
    def demand(self) -> dict[str, int]:
        """Pages needed per kind: the largest per-layer sum of ranks."""
        return {
            kind: max(sum(p.rank for p in parts) for parts in layers.values())
            for kind, layers in self.parts.items()
        }

    @property
    def max_rank(self) -> int:
        return max(p.rank for layers in self.parts.values() for ps in layers.values() for p in ps)


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: the first key matching the end of the name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_peft_adapter(path: str | Path, targets: LoRATargets, dtype: torch.dtype) -> AdapterWeights:
    """Read and check a peft LoRA folder against the base model. Raises ValueError naming
    the first thing that does not fit."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a peft adapter folder: no adapter_config.json")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": config.get("use_dora"),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": config.get("modules_to_save"),
        "fan_in_fan_out": config.get("fan_in_fan_out"),
        "lora_bias": config.get("lora_bias"),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{path}: LoRA options not supported: {', '.join(bad)}")
    tensors = _load_tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, tensor in tensors.items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        match = _KEY_RE.match(name)
        if match is None:
            others.append(key)
        else:
            pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    alpha, use_rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))
    weights = AdapterWeights(str(path))
    for module, ab in sorted(pairs.items()):
        if module not in targets.by_hf_name:
            raise ValueError(
                f"{path}: module {module!r} is not a LoRA-able linear of the base model "
                f"(LoRA-able: {targets.describe()} in each decoder layer)"
            )
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: module {module!r} has lora_{set('AB') - set(ab)} missing")
        kind_name, layer, part = targets.by_hf_name[module]
        kind = targets.kinds[kind_name]
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        rank = a.shape[0]
        want_a = (rank, kind.in_features)
        want_b = (kind.part_sizes[part], rank)
        if a.dim() != 2 or tuple(a.shape) != want_a:
            raise ValueError(
                f"{path}: lora_A of {module} is {list(a.shape)} but the base model's "
                f"{kind.part_names[part]} takes {kind.in_features} inputs (expected {list(want_a)})"
            )
        if b.dim() != 2 or tuple(b.shape) != want_b:
            raise ValueError(
                f"{path}: lora_B of {module} is {list(b.shape)} but the base model's "
                f"{kind.part_names[part]} has {kind.part_sizes[part]} outputs and the rank is "
                f"{rank} (expected {list(want_b)})"
            )
        module_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)
        scale = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        lora_part = LoRAPart(part, a.to(dtype).contiguous(), b.to(dtype).contiguous(), scale)
        weights.parts.setdefault(kind_name, {}).setdefault(layer, []).append(lora_part)
    if others:  # NOTE: after the LoRA modules, whose errors name the cause better
        raise ValueError(f"{path}: unexpected tensor {others[0]!r} (only lora_A / lora_B weights)")
    for layers in weights.parts.values():
        for parts in layers.values():
            parts.sort(key=lambda p: p.part)
    return weights


def _load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    binary = folder / "adapter_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ValueError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


class LoRAPool:
    """Host copies of adapters and the device pages of every LoRA-able linear.

    Does what a SchedulerOutput's AdapterPlan says (load into pages, drop host copies) and
    builds each step's `LoRAStep`; never decides residency. With `max_cpu_loras`, at most
    that many adapters keep host copies: the least recently loaded ones are dropped and read
    again from their folder when the scheduler next loads them into pages.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.targets = find_lora_targets(model)
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.capacity: dict[str, int] = {}  # kind -> pages; empty until `enable`
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # least recently used first
        self.paths: dict[int, str] = {}  # adapter_id -> folder, for every stored adapter
        self.max_cpu_loras: int | None = None
        self.num_reads = 0  # host copies read again after being dropped
        self._allocated: set[str] = set()

    @property
    def is_enabled(self) -> bool:
        return bool(self.capacity)

    def enable(
        self, max_lora_slots: int, max_lora_rank: int, max_cpu_loras: int | None = None
    ) -> dict[str, int]:
        """Size the pool: per kind, `max_lora_slots` adapters of `max_lora_rank` on every part,
        and at most `max_cpu_loras` host copies (None: all). Returns the capacity (kind ->
        pages); tensors are allocated per kind on first use."""
        if not self.targets.kinds:
            raise ValueError("this model has no LoRA-able linears inside decoder layers")
        self.max_cpu_loras = max_cpu_loras
        self.capacity = {
            name: max_lora_slots * max_lora_rank * len(kind.part_names)
            for name, kind in self.targets.kinds.items()
        }
        return self.capacity

    def read(self, path: str) -> AdapterWeights:
        return read_peft_adapter(path, self.targets, self.dtype)

    def store(self, adapter_id: int, weights: AdapterWeights) -> None:
        """Keep `weights` on the host; allocate the device pool of every kind it targets."""
        for kind_name in weights.parts:
            if kind_name not in self._allocated:
                kind = self.targets.kinds[kind_name]
                for module in kind.modules.values():
                    enable_lora(module, kind_name, self.capacity[kind_name])
                self._allocated.add(kind_name)
        self.paths[adapter_id] = weights.path
        self._keep(adapter_id, weights)

    def _keep(self, adapter_id: int, weights: AdapterWeights) -> None:
        """Hold `weights` as the most recently used host copy, within `max_cpu_loras`."""
        self.host[adapter_id] = weights
        self.host.move_to_end(adapter_id)
        while self.max_cpu_loras is not None and len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def host_weights(self, adapter_id: int) -> AdapterWeights:
        """Adapter `adapter_id`'s host copy, read again from its folder if it was dropped."""
        weights = self.host.get(adapter_id)
        if weights is None:
            weights = self.read(self.paths[adapter_id])
            self.num_reads += 1
        self._keep(adapter_id, weights)
        return weights

    @torch.inference_mode()
    def apply(self, plan: AdapterPlan) -> None:
        for load in plan.loads:
            self._load(load.adapter_id, load.pages)
        for adapter_id in plan.drops:
            self.host.pop(adapter_id, None)
            self.paths.pop(adapter_id, None)

    def _load(self, adapter_id: int, pages: dict[str, list[int]]) -> None:
        weights = self.host_weights(adapter_id)
        for kind_name, kind_pages in pages.items():
            kind = self.targets.kinds[kind_name]
            index = torch.tensor(kind_pages, device=self.device)
            layers = weights.parts.get(kind_name, {})
            for layer, module in kind.modules.items():
                module.lora_a[index] = 0
                module.lora_b[index] = 0
                module.lora_scale[index] = 0
                module.lora_cols[index.cpu()] = torch.tensor([0, kind.out_features])
                first = 0
                for p in layers.get(layer, ()):
                    rows = index[first : first + p.rank]
                    cols = slice(kind.part_offset(p.part), kind.part_offset(p.part + 1))
                    module.lora_a[rows] = p.lora_a.to(self.device)
                    module.lora_b[rows, cols] = p.lora_b.t().to(self.device)
                    module.lora_scale[rows] = p.scale
                    module.lora_cols[rows.cpu()] = torch.tensor([cols.start, cols.stop])
                    first += p.rank

    def step(self, adapter_ids: list[int | None], q_lens: torch.Tensor, plan: AdapterPlan):
        """The LoRAStep of a batch whose i-th sequence uses adapter `adapter_ids[i]` and has
        `q_lens[i]` tokens; None when no sequence uses an adapter."""
        if not plan.page_tables:
            return None
        order = list(plan.page_tables)  # row of each step adapter in the page tables
        row = {adapter_id: i for i, adapter_id in enumerate(order)}
        seq_rows = torch.tensor([row.get(i, -1) if i is not None else -1 for i in adapter_ids])
        meta = LoRAMeta.build(torch.repeat_interleave(seq_rows, q_lens))  # [num_tokens]
        page_tables = {}
        for kind_name in self._allocated:
            tables = [plan.page_tables[i].get(kind_name, []) for i in order]
            width = max(len(t) for t in tables)
            if width == 0:
                continue
            pad = self.capacity[kind_name]  # the zero page
            rows = [t + [pad] * (width - len(t)) for t in tables]
            page_tables[kind_name] = torch.tensor(rows, device=self.device)  # [A, width]
        return LoRAStep(meta.to(self.device, self.dtype), page_tables)
