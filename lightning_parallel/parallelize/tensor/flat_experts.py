"""Experts kept as flat 2-D parameters ``[E·I, H]`` that the experts module views per expert (DBRX), split per expert.

DBRX keeps its experts in ``DbrxExperts`` -> ``DbrxExpertGLU`` as three parameters ``w1``, ``v1``, ``w2`` of shape
``[E·I, H]`` (the expert count ``E`` and hidden units ``I`` come from the config's ``ffn_config``); the experts module
views each as ``[E, I, H]`` by ``self.ffn_hidden_size`` and runs each expert's gated MLP on its tokens. Every row is
one hidden unit of one expert, so the experts split like transformers' fused ones
(:mod:`~lightning_parallel.parallelize.tensor.experts`): each parameter's rows, in ``E`` blocks of ``I``, are reordered
rank-major and sharded (``Shard(0)``; rank ``r`` holds part ``r`` of every expert), the attributes holding ``I`` on
the experts module and below it are divided by the TP degree, and during its forward the experts module and its
children read their rank's slices. Its floating inputs (hidden states, routing weights) enter with their gradients
summed over the group in backward and its output, each rank's partial sum, is all-reduced.

Recognised by structure inside a block (the module given the ``experts`` style): one child holding an expert count
``E`` (``num_experts``, ``moe_num_experts``) and, below it, only 2-D parameters of one shape ``[E·I, H]``, with
``I`` kept as an attribute. That every row is a unit used on its own is checked by running the block once on a
small random input, whole and split over two simulated ranks (the experts module's outputs summed): the experts are
split only where both agree. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallelize.tensor import fused as fused_layout
from lightning_parallel.parallelize.tensor.partial_gradients import gradient_summed
from lightning_parallel.parallelize.tensor.probe import random_tensors, whole_and_split_difference

#: Attributes an experts module keeps its expert count under.
EXPERT_COUNTS = ("num_experts", "moe_num_experts", "num_local_experts")
#: Largest relative difference between the block run whole and split still counted as the same (float32 sums).
TOLERANCE = 1e-4


@dataclass(frozen=True)
class FlatExpertsLayout:
    """A block's experts as flat ``[E·I, H]`` parameters under one child.

    Attributes:
        experts: The child holding them (relative to the block).
        parameters: Their names, relative to ``experts``.
        widths: ``(module relative to experts, attribute)`` holding ``I`` (divided by the TP degree).
        num_experts: ``E``.
        intermediate: Hidden units of one expert (``I``).
    """

    experts: str
    parameters: tuple[str, ...]
    widths: tuple[tuple[str, str], ...]
    num_experts: int
    intermediate: int


def flat_experts_layout(block: nn.Module) -> FlatExpertsLayout | str | None:
    """``block``'s flat experts; a reason (``str``) where they do not split per hidden unit; ``None``: none held."""
    for child_name, child in block.named_children():
        count = next((v for n in EXPERT_COUNTS if _count(v := getattr(child, n, None))), None)
        params = dict(child.named_parameters())
        shapes = {tuple(p.shape) for p in params.values()}
        if count is None or not params or len(shapes) != 1 or len(next(iter(shapes))) != 2:
            continue
        rows, width = next(iter(shapes))
        if rows % count or rows == count:
            continue
        intermediate = rows // count
        widths = tuple((name, attr) for name, sub in child.named_modules() for attr, value in vars(sub).items()
                       if not attr.startswith("_") and _count(value) and value == intermediate and attr not in EXPERT_COUNTS)
        if not any(name == "" for name, _ in widths):
            continue  # nothing on the experts module says how it views its rows per expert
        if intermediate in (width, count):
            return (f"its experts {child_name} hold [{rows}, {width}] parameters whose {intermediate} hidden units per "
                    f"expert equal another of their sizes, so which attributes give them is ambiguous")
        layout = FlatExpertsLayout(child_name, tuple(params), widths, count, intermediate)
        difference = _split_difference(block, layout)
        if difference is None:
            return (f"its experts {child_name} could not be checked to split per hidden unit (the block's forward, run "
                    f"on a random input of its width alone, failed)")
        if difference > TOLERANCE:
            return (f"its experts {child_name} do not split per hidden unit (split over 2 ranks, the block's output "
                    f"differs from the whole one's by {difference:.1e} on a random input)")
        return layout
    return None


def split_flat_experts(block: nn.Module, layout: FlatExpertsLayout, tp_mesh: Any) -> None:
    """Shard ``block``'s flat experts over ``tp_mesh`` (see the module docstring); state dicts keep the module's order."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp_size = tp_mesh.size()
    experts = block.get_submodule(layout.experts)
    owners: dict[nn.Module, list[str]] = {}
    for name in layout.parameters:
        owner_name, _, param_name = name.rpartition(".")
        owner = experts.get_submodule(owner_name)
        param = owner._parameters[param_name]
        rows = fused_layout.FusedLayout(0, (layout.intermediate,) * layout.num_experts, tp_size)
        fused_layout.rank_major_rows(param, rows)
        placed = distribute_tensor(param.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
        owner.register_parameter(param_name, nn.Parameter(placed, requires_grad=param.requires_grad))
        owners.setdefault(owner, []).append(param_name)
    for owner, names in owners.items():  # once per module: its state-dict hooks convert every named parameter
        fused_layout.mark(owner, {name: fused_layout.FusedLayout(0, (layout.intermediate,) * layout.num_experts, tp_size)
                                  for name in names})
    for module_name, attr in layout.widths:
        setattr(experts.get_submodule(module_name), attr, layout.intermediate // tp_size)

    def enter(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for owner, names in owners.items():  # the experts module reads its children's parameters itself
            for name in names:
                owner.__dict__[name] = owner._parameters[name].to_local()
        return tuple(gradient_summed(a, tp_mesh) for a in args), {k: gradient_summed(v, tp_mesh) for k, v in kwargs.items()}

    def leave(_: nn.Module, __: tuple, output: Any) -> Any:
        for owner, names in owners.items():
            for name in names:
                owner.__dict__.pop(name, None)
        return _all_reduced(output, tp_mesh) if isinstance(output, Tensor) else output

    experts.register_forward_pre_hook(enter, with_kwargs=True)
    experts.register_forward_hook(leave, always_call=True)


def _all_reduced(partial: Tensor, mesh: Any) -> Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _split_difference(block: nn.Module, layout: FlatExpertsLayout, tp_size: int = 2) -> float | None:
    """Relative difference between ``block`` run whole and split over ``tp_size`` simulated ranks (``None``: not run)."""
    from torch.func import functional_call

    if layout.intermediate % tp_size:
        return 0.0  # the degree check refuses it with its own message
    probed = random_tensors(block)
    if probed is None:
        return None
    weights, buffers, generator = probed
    experts = block.get_submodule(layout.experts)
    width = next(p for p in experts.parameters()).shape[1]
    hidden = torch.randn(2, 3, width, generator=generator)
    part = layout.intermediate // tp_size
    ranks = []
    for rank in range(tp_size):
        rows = torch.cat([torch.arange(e * layout.intermediate + rank * part, e * layout.intermediate + (rank + 1) * part)
                          for e in range(layout.num_experts)])
        ranks.append({**weights, **buffers, **{f"{layout.experts}.{n}": weights[f"{layout.experts}.{n}"][rows] for n in layout.parameters}})
    modules = [(experts.get_submodule(m), attr) for m, attr in layout.widths]

    def run(tensors: dict[str, Tensor], summed: list[Tensor], split: bool) -> tuple[Any, list[Tensor]]:
        outputs: list[Tensor] = []

        def replace(_: nn.Module, __: Any, output: Tensor) -> Tensor:
            outputs.append(output)
            return summed[len(outputs) - 1] if len(outputs) <= len(summed) else output

        hook = experts.register_forward_hook(replace)
        try:
            for module, attr in modules:
                setattr(module, attr, part if split else layout.intermediate)
            return functional_call(block, tensors, (hidden,)), outputs
        finally:
            hook.remove()
            for module, attr in modules:
                setattr(module, attr, layout.intermediate)

    return whole_and_split_difference(run, {**weights, **buffers}, ranks)
