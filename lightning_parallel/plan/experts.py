"""Routed experts in a meta-device dry run: computed as if the router spread the tokens evenly.

An experts module's own forward picks each expert's tokens by data-dependent counts (``torch.where`` on the
router's choices), which the meta device cannot know (``nonzero`` has no meta kernel). For the dry run each
routed-experts module (:func:`~lightning_parallel.parallelize.expert.experts.find_routed_experts`) computes
instead what a balanced router costs: every expert gets ``⌈tokens × k / E⌉`` tokens, through its up and down
weights (one batched matmul each), so FLOPs, saved activations and gradients are those of training at even
load; its output keeps the gradient paths to the hidden states and the routing weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallelize.expert.experts import RoutedExperts, find_routed_experts

_UP_NAMES = ("gate_up_proj", "up_proj")


class RoutedTraffic:
    """What the routed experts of a dry run would send through expert parallelism's all-to-alls.

    Attributes:
        pair_bytes: Bytes of the hidden states of every (token, choice) pair entering routed experts, summed over
            the MoE layer calls of the step (one way, forward).
        calls: MoE layer calls in the step's forward.
        parameters: Full names (relative to the dry-run module) of the routed-experts parameters.
        counts: Routed experts per MoE layer (every count an expert-parallel size must divide).
    """

    def __init__(self) -> None:
        self.pair_bytes = 0.0
        self.calls = 0
        self.parameters: set[str] = set()
        self.counts: set[int] = set()


@contextmanager
def balanced_routing(module: nn.Module) -> Iterator[RoutedTraffic]:
    """Within the block, every routed-experts module of ``module`` runs :class:`_BalancedExperts`; yields what
    they route."""
    patched, traffic = [], RoutedTraffic()
    for fqn, routed in find_routed_experts(module).items():
        if isinstance(routed, RoutedExperts):
            sub = module.get_submodule(fqn)
            sub.forward = _BalancedExperts(sub, routed, traffic)  # an instance attribute shadows the class's forward
            patched.append(sub)
            traffic.parameters.update(f"{fqn}.{name}" if fqn else name for name in routed.parameters)
            traffic.counts.add(routed.num_experts)
    try:
        yield traffic
    finally:
        for sub in patched:
            sub.__dict__.pop("forward", None)


class _BalancedExperts:
    def __init__(self, module: nn.Module, routed: RoutedExperts, traffic: RoutedTraffic) -> None:
        self.module, self.routed, self.traffic = module, routed, traffic

    def __call__(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *_: Any, **__: Any) -> Tensor:
        module, experts = self.module, self.routed.num_experts
        up = next(getattr(module, name) for name in _UP_NAMES if name in self.routed.parameters)
        down = module.down_proj
        flat = hidden.reshape(-1, hidden.shape[-1])
        width = flat.shape[-1]
        pairs = flat.shape[0] * top_k_index.shape[-1]
        self.traffic.pair_bytes += pairs * width * flat.element_size()
        self.traffic.calls += 1
        per_expert = max(1, -(-pairs // experts))
        tokens = flat[:1].expand(per_expert, width).unsqueeze(0).expand(experts, per_expert, width)
        inner = torch.bmm(tokens, up.reshape(experts, width, -1))  # up[e]'s FLOPs per token, whatever its layout
        units = down[0].numel() // width
        out = torch.bmm(inner[..., :units], down.reshape(experts, units, width))
        # Shape of the real output; the gradient reaches the tokens, the weights and both projections.
        return flat + (out.sum() + top_k_weights.sum()) * 0
