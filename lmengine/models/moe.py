"""What the patched mixture-of-experts blocks share: the experts as the 3-D parameters
transformers loads (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) run by
the batched expert kernel (kernels/moe.py), behind a router each block defines.

Neither the router nor the experts are nn.Linears, so linear transforms (TP, LoRA, w8a8) do
not see them. On the CPU the expert weights move to huge pages at the first forward, once they
are final (under tensor parallelism they arrive after patching): kernels/huge_pages.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lmengine.distributed.comm import all_reduce
from lmengine.kernels.huge_pages import on_huge_pages
from lmengine.kernels.moe import fused_moe, pack_experts


class ExpertsMixin:
    """A block with `experts` (HF's 3-D expert parameters and `act_fn`) and a `route` method:
    hidden [num_tokens, H] -> (weights [num_tokens, top_k], expert ids [num_tokens, top_k])."""

    experts: Any  # HF's experts module: gate_up_proj, down_proj, act_fn

    def lmengine_post_patch(self) -> None:
        """Pack each expert's weights for the CPU GEMMs (None where that does not apply).
        Whoever changes the expert weights afterwards calls this again."""
        gate_up = pack_experts(self.experts.gate_up_proj)
        down = pack_experts(self.experts.down_proj)
        self.packed_experts = None if gate_up is None or down is None else (gate_up, down)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    # under tensor parallelism, the experts [start, stop) this rank holds (distributed/shard.py)
    lmengine_expert_range: tuple[int, int] | None = None
    # the expert weights were moved to huge pages (at the first forward)
    experts_placed = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.run_experts(hidden_states)

    def run_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [num_tokens, H] (under tensor parallelism: summed
        over the ranks, each holding some of the experts)."""
        topk_weights, topk_ids = self.route(hidden_states)
        expert_range = self.lmengine_expert_range
        if expert_range is not None:
            topk_weights, topk_ids = local_slots(topk_weights, topk_ids, expert_range)
        out = self._fused(hidden_states, topk_weights, topk_ids)
        return out if expert_range is None else all_reduce(out)

    def expert_act(self) -> Any:
        """The experts' activation for fused_moe (gpt-oss overrides: a gated one)."""
        return self.experts.act_fn

    def place_experts(self) -> None:
        """The expert weights on huge pages (CPU; kernels/huge_pages.py), once."""
        experts = self.experts
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name).detach()
            placed = on_huge_pages(weight)
            if placed is not weight:
                setattr(experts, name, torch.nn.Parameter(placed, requires_grad=False))
        self.experts_placed = True

    def _fused(self, hidden_states, topk_weights, topk_ids) -> torch.Tensor:
        if not self.experts_placed:
            self.place_experts()
        experts = self.experts
        return fused_moe(
            hidden_states,
            experts.gate_up_proj,
            experts.down_proj,
            topk_weights,
            topk_ids,
            self.expert_act(),
            self.packed_experts,
            # per-expert biases where the experts have them (gpt-oss)
            b_gate_up=getattr(experts, "gate_up_proj_bias", None),
            b_down=getattr(experts, "down_proj_bias", None),
        )


def softmax_top_k(
    router: Any, hidden_states: torch.Tensor, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, then the top k (Mixtral, Qwen3-MoE), renormalized
    to sum to one when `normalize`. `router`: HF's router (`weight` [E, H], `top_k`)."""
    logits = F.linear(hidden_states, router.weight)  # [num_tokens, num_experts]
    weights, ids = logits.float().softmax(-1).topk(router.top_k, dim=-1)  # [num_tokens, top_k]
    if normalize:
        weights /= weights.sum(-1, keepdim=True)
    return weights, ids


def local_slots(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_range: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing restricted to the experts [start, stop) one rank holds, as ids into them:
    a slot of another rank's expert gets id -1 (fused_moe leaves it out), so the sum over ranks
    is the full mixture."""
    start, stop = expert_range
    local = (topk_ids >= start) & (topk_ids < stop)
    return topk_weights, torch.where(local, topk_ids - start, torch.full_like(topk_ids, -1))
