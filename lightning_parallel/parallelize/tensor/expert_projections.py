"""Experts held as two per-expert projection modules (JetMoE's ``ParallelExperts``), split column- then row-wise.

Some MoE blocks keep their experts not as transformers' fused ``gate_up_proj``/``down_proj`` parameters
(:mod:`~lightning_parallel.parallelize.tensor.experts`) but as two modules, each a batch of per-expert linear maps:
one parameter ``weight [E, out, in]`` and ``num_experts = E`` (JetMoE's ``input_linear [E, 2·I, H]`` and
``output_linear [E, H, I]``, called with the tokens sorted by expert and each expert's count). Such a pair inside one
module — one projection reading the block's width ``H`` and writing ``I`` or ``2·I`` (gate | up, concatenated), the
other reading ``I`` and writing ``H`` — is an MLP per expert, and splits as Megatron splits one:

- the opening projection column-wise: every expert's ``I`` hidden units (of each of gate and up) split over the
  ranks (``Shard(1)`` of the rows reordered rank-major, :mod:`~lightning_parallel.parallelize.tensor.fused`); its
  input enters replicated with its gradient summed over the group in backward (each rank's is a partial sum);
- the closing projection row-wise (``Shard(2)``); its output is all-reduced right where it is computed, so that
  what the block does after it (the routing weights, scattering tokens back, a bias) runs on whole values and the
  router's gradient is the whole one.

Each projection's forward reads its rank's slice (``to_local()``) as ``self.weight`` during the call. Nothing in
the module tree says that the block runs the pair as one MLP per expert (JetMoE's attention experts ``MoA`` hold the
same pair around an attention): the block's own forward is run once on a small random input, whole and split (the
closing projection's calls summed over the ranks), and the pair is split only where both agree. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallelize.tensor import fused as fused_layout
from lightning_parallel.parallelize.tensor.partial_gradients import gradient_summed
from lightning_parallel.parallelize.tensor.per_head import LocalView
from lightning_parallel.parallelize.tensor.probe import random_tensors, whole_and_split_difference

#: Attributes a per-expert projection module keeps its expert count under.
EXPERT_COUNTS = ("num_experts", "num_local_experts")
#: Largest relative difference between the block run whole and split still counted as the same (float32 sums).
TOLERANCE = 1e-4


@dataclass(frozen=True)
class ProjectionPairLayout:
    """A block's experts as two per-expert projection children.

    Attributes:
        opening: Child reading the block's width, ``weight [E, k·I, H]`` (``k = 2``: gate | up).
        closing: Child writing the block's width, ``weight [E, H, I]``.
        gated: The opening projection writes gate | up (``2·I``).
        num_experts: ``E``.
        intermediate: Hidden units of one expert (``I``).
    """

    opening: str
    closing: str
    gated: bool
    num_experts: int
    intermediate: int

    def blocks(self) -> tuple[int, ...]:
        """The opening projection's blocks along its output rows."""
        return (self.intermediate,) * (2 if self.gated else 1)


def expert_projection(module: nn.Module) -> tuple[int, int, int] | None:
    """``(E, out, in)`` of a per-expert projection module (one 3-D ``weight`` and its expert count), else ``None``."""
    params = dict(module.named_parameters())
    weight = params.get("weight")
    if len(params) != 1 or weight is None or weight.dim() != 3:
        return None
    if not any(getattr(module, name, None) == weight.shape[0] for name in EXPERT_COUNTS):
        return None
    return tuple(int(size) for size in weight.shape)


def projection_pair_layout(module: nn.Module) -> ProjectionPairLayout | str | None:
    """``module``'s two per-expert projection children as an MLP per expert; a reason (``str``) where such a pair
    does not run as one; ``None`` where ``module`` holds no such pair."""
    found = {name: shape for name, child in module.named_children() if (shape := expert_projection(child)) is not None}
    if len(found) != 2:
        return None
    (a, (ea, out_a, in_a)), (b, (eb, out_b, in_b)) = found.items()
    for opening, (_, out_o, in_o), closing, (_, out_c, in_c) in ((a, found[a], b, found[b]), (b, found[b], a, found[a])):
        if ea == eb and in_o == out_c and out_o in (in_c, 2 * in_c) and in_o != in_c:
            layout = ProjectionPairLayout(opening, closing, out_o == 2 * in_c, ea, in_c)
            break
    else:
        return None
    difference = _split_difference(module, layout)
    if difference is None:
        return (f"its expert projections {layout.opening} and {layout.closing} could not be checked to run as one MLP "
                f"per expert (its forward, run on a random input of its width alone, failed)")
    if difference > TOLERANCE:
        return (f"its expert projections {layout.opening} and {layout.closing} do not run as one MLP per expert (split "
                f"over 2 ranks, its output differs from the whole block's by {difference:.1e} on a random input)")
    return layout


def split_projection_pair(module: nn.Module, layout: ProjectionPairLayout, tp_mesh: Any) -> None:
    """Shard ``module``'s pair over ``tp_mesh`` (see the module docstring); state dicts stay in the module's order."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp_size = tp_mesh.size()
    for name, dim in ((layout.opening, 1), (layout.closing, 2)):
        child = module.get_submodule(name)
        param = child._parameters["weight"]
        if dim == 1 and layout.gated:
            blocks = fused_layout.FusedLayout(dim, layout.blocks(), tp_size)
            fused_layout.rank_major_rows(param, blocks)
            placed = distribute_tensor(param.detach(), tp_mesh, [Shard(dim)], src_data_rank=None)
            child.register_parameter("weight", nn.Parameter(placed, requires_grad=param.requires_grad))
            fused_layout.mark(child, {"weight": blocks})
        else:
            placed = distribute_tensor(param.detach(), tp_mesh, [Shard(dim)], src_data_rank=None)
            child.register_parameter("weight", nn.Parameter(placed, requires_grad=param.requires_grad))
        sliced = LocalView(("weight",))
        child.register_forward_pre_hook(sliced.enter)
        child.register_forward_hook(sliced.leave, always_call=True)
    opening, closing = module.get_submodule(layout.opening), module.get_submodule(layout.closing)
    opening.register_forward_pre_hook(
        lambda _, args, kwargs: (tuple(gradient_summed(a, tp_mesh) for a in args),
                                 {k: gradient_summed(v, tp_mesh) for k, v in kwargs.items()}),
        with_kwargs=True)
    closing.register_forward_hook(lambda _, __, output: _all_reduced(output, tp_mesh) if isinstance(output, Tensor) else output)


def _all_reduced(partial: Tensor, mesh: Any) -> Tensor:
    """Every rank's partial sum, summed (forward); the replicated gradient passed through (backward)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()


def _split_difference(module: nn.Module, layout: ProjectionPairLayout, tp_size: int = 2) -> float | None:
    """Relative difference between ``module`` run whole and split over ``tp_size`` simulated ranks (``None``: not run)."""
    from torch.func import functional_call

    if layout.intermediate % tp_size:
        return 0.0  # the degree check refuses it with its own message
    probed = random_tensors(module)
    if probed is None:
        return None
    weights, buffers, generator = probed
    width = module.get_submodule(layout.opening).weight.shape[2]
    hidden = torch.randn(2, 3, width, generator=generator)
    closing = module.get_submodule(layout.closing)
    opening_weight, closing_weight = f"{layout.opening}.weight", f"{layout.closing}.weight"

    def run(tensors: dict[str, Tensor], summed: list[Tensor], split: bool) -> tuple[Any, list[Tensor]]:
        outputs: list[Tensor] = []

        def replace(_: nn.Module, __: Any, output: Tensor) -> Tensor:
            outputs.append(output)
            return summed[len(outputs) - 1] if len(outputs) <= len(summed) else output

        hook = closing.register_forward_hook(replace)
        try:
            return functional_call(module, tensors, (hidden,)), outputs
        finally:
            hook.remove()

    ranks = []
    for rank in range(tp_size):
        rows = torch.cat([torch.arange(start + rank * size // tp_size, start + (rank + 1) * size // tp_size)
                          for start, size in zip(range(0, sum(layout.blocks()), layout.intermediate), layout.blocks())])
        part = layout.intermediate // tp_size
        ranks.append({**weights, **buffers, opening_weight: weights[opening_weight].index_select(1, rows),
                      closing_weight: weights[closing_weight].narrow(2, rank * part, part)})
    return whole_and_split_difference(run, {**weights, **buffers}, ranks)
