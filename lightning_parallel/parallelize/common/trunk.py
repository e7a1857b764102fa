"""A model's trunk: its longest ``nn.ModuleList``/``nn.Sequential`` of layers (a transformer's blocks).

Pipelines cut between the trunk's layers; activation checkpointing and ``torch.compile`` wrap them one by one.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_parallel.parallelize.common.expert_lists import find_expert_lists


def find_trunk(module: nn.Module, calls: Mapping[int, int] | None = None) -> tuple[str, nn.Module]:
    """The longest ``ModuleList``/``Sequential`` in ``module`` (ties: more parameters), with its name.

    Args:
        calls: How many times one forward ran each module (``id(module) -> count``): where given, lists whose layers
            each run exactly once win over the others (a multimodal model's longest list may be an encoder that a
            text-only batch never runs: a stage cannot begin at a layer forward does not call).

    Raises:
        ValueError: If the module has no list of at least two layers to split between.
    """
    # A Mixture-of-Experts block's experts (an nn.ModuleList beside a router) are not layers: a stage cannot begin
    # inside the block's loop over them, which the pipeline's trace keeps whole.
    experts = set(find_expert_lists(module))
    candidates = [
        (len(child), parameter_count(child), name, child)
        for name, child in module.named_modules()
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) >= 2 and name not in experts
    ]
    if calls is not None:
        running = [c for c in candidates if all(calls.get(id(layer), 0) == 1 for layer in c[3].children())]
        candidates = running or candidates
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no nn.ModuleList or nn.Sequential of layers to split into pipeline stages. "
            f"Keep the repeated layers in one (e.g. self.blocks = nn.ModuleList(...)), or give split_points explicitly."
        )
    _, _, name, trunk = max(candidates, key=lambda c: (c[0], c[1]))
    return name, trunk


def trunk_layer_names(trunk_name: str, trunk: nn.Module) -> list[str]:
    """Names of the trunk's layers relative to the pipelined module (``blocks.0``, ``blocks.1``, ...)."""
    return [f"{trunk_name}.{child}" if trunk_name else child for child, _ in trunk.named_children()]


def parameter_count(module: nn.Module) -> int:
    """Parameters of ``module`` (tied ones once)."""
    return sum(p.numel() for p in module.parameters())
