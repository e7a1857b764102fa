"""Grouped experts of a Mixture-of-Experts block split over tensor-parallel ranks along their hidden units.

transformers 5 keeps a MoE block's routed experts as fused 3-D parameters on one module (``MixtralExperts``:
``gate_up_proj [E, 2·I, H]``, ``down_proj [E, H, I]``; "transposed" families store ``[E, H, 2·I]`` /
``[E, I, H]``; gpt-oss interleaves gate and up and adds biases), decorated by ``@use_experts_implementation``,
which records that layout on the module (``has_gate``, ``is_transposed``, ``is_concatenated``, ``has_bias``)
and picks the forward the model chose (``eager``, ``grouped_mm``, ``batched_mm``).

Under tensor parallelism every expert is split as a gated MLP is (Megatron's expert tensor parallelism):
``gate_up`` column-wise — each of the gate and up blocks split, rank ``r`` holding part ``r`` of both, the
rows reordered rank-major as :mod:`~lightning_parallel.parallelize.tensor.fused` does for ``gate_up_proj``
linears (an interleaved layout already is) — and ``down`` row-wise. The experts module then runs its own
forward, in the implementation the model chose, on this rank's slices (their ``to_local()`` views, read as
the module's attributes during the call, as per-head parameters are), so every rank computes a partial sum of
each token's expert output:

- the floating inputs (hidden states, routing weights) enter as replicated tensors whose gradients are partial
  sums, all-reduced in backward (the router's gradient is then the whole one);
- the output is all-reduced in forward (identity in backward);
- a ``down`` bias, added once per token in the unsplit model, is added as ``bias / tp`` on every rank (the
  sum restores it) and its gradient, a partial sum, is summed over the group after backward with the other
  replicated-in-a-split-region parameters (:func:`~lightning_parallel.parallelize.tensor.split_region.reduce_split_region_gradients`).

Routing is computed on every rank from the same replicated input and router, so every rank routes alike.
Checkpoints hold the experts in the module's own layout (rank-major order exists only while training).
No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_parallel.parallelize.tensor import fused as fused_layout
from lightning_parallel.parallelize.tensor.flat_experts import FlatExpertsLayout, flat_experts_layout, split_flat_experts
from lightning_parallel.parallelize.tensor.expert_projections import (
    ProjectionPairLayout,
    projection_pair_layout,
    split_projection_pair,
)
from lightning_parallel.parallelize.tensor.partial_gradients import gradient_summed
from lightning_parallel.parallelize.tensor.per_head import LocalView
from lightning_parallel.parallelize.tensor.split_region import PartialSumParameters

#: The down projection's parameter name; the up projection is ``gate_up_proj`` (gated) or ``up_proj``.
DOWN = "down_proj"
UP_NAMES = ("gate_up_proj", "up_proj")
#: Attributes ``@use_experts_implementation`` sets on the module, giving its layout.
_LAYOUT_ATTRIBUTES = ("is_transposed", "is_concatenated", "has_gate")
#: Packages whose undecorated 3-D experts follow transformers' layout convention (``gate | up`` concatenated).
_CONVENTION_PACKAGES = ("transformers.models.",)


@dataclass(frozen=True)
class ExpertsLayout:
    """How one module's grouped experts are stored.

    Attributes:
        up: Name of the up (or fused gate|up) parameter.
        gated: ``up`` holds a gate block and an up block.
        transposed: Weights stored ``[E, in, out]`` (else ``[E, out, in]``, as ``nn.Linear``).
        concatenated: The gate and up blocks follow each other (``gate | up``); else interleaved per unit.
        num_experts: ``E``.
        intermediate: Hidden units of one expert (``I``; the up parameter is ``2·I`` wide when gated).
        biases: Bias parameters held beside the weights (``gate_up_proj_bias``, ``down_proj_bias``).
    """

    up: str
    gated: bool
    transposed: bool
    concatenated: bool
    num_experts: int
    intermediate: int
    biases: tuple[str, ...] = ()

    @property
    def up_dim(self) -> int:
        """The up weight's output-feature dimension (split column-wise)."""
        return 2 if self.transposed else 1

    @property
    def down_dim(self) -> int:
        """The down weight's input-feature dimension (split row-wise)."""
        return 1 if self.transposed else 2

    def split_dims(self) -> dict[str, int]:
        """Parameter name -> the dimension split over the ranks (the ``down`` bias stays whole)."""
        dims = {self.up: self.up_dim, DOWN: self.down_dim}
        if f"{self.up}_bias" in self.biases:
            dims[f"{self.up}_bias"] = 1
        return dims

    def fused_blocks(self) -> tuple[int, ...] | None:
        """Sizes of the gate and up blocks along the split dimension, where they must be reordered rank-major."""
        return (self.intermediate, self.intermediate) if self.gated and self.concatenated else None


def experts_layout(module: nn.Module) -> ExpertsLayout | ProjectionPairLayout | FlatExpertsLayout | str | None:
    """``module``'s grouped-experts layout; a reason (``str``) where it holds experts this cannot split;
    ``None`` where it holds no grouped experts (3-D ``gate_up_proj``/``up_proj`` and ``down_proj``, or two per-expert
    projection children: :mod:`~lightning_parallel.parallelize.tensor.expert_projections`; flat ``[E·I, H]`` parameters
    of a child: :mod:`~lightning_parallel.parallelize.tensor.flat_experts`)."""
    params = dict(module.named_parameters(recurse=False))
    up = next((name for name in UP_NAMES if name in params), None)
    if up is None or DOWN not in params or params[up].dim() != 3 or params[DOWN].dim() != 3:
        pair = projection_pair_layout(module)
        return pair if pair is not None else flat_experts_layout(module)
    up_shape, down_shape = tuple(params[up].shape), tuple(params[DOWN].shape)
    gated = bool(getattr(module, "has_gate", up == "gate_up_proj"))
    factor = 2 if gated else 1
    # [E, factor·I, H] with [E, H, I], or transposed [E, H, factor·I] with [E, I, H].
    plain = up_shape[1] == factor * down_shape[2] and up_shape[2] == down_shape[1]
    flipped = up_shape[2] == factor * down_shape[1] and up_shape[1] == down_shape[2]
    if up_shape[0] != down_shape[0] or not (plain or flipped):
        return f"its {up} {list(up_shape)} and {DOWN} {list(down_shape)} are not the two halves of a (gated) MLP per expert"
    transposed = getattr(module, "is_transposed", None)
    if not isinstance(transposed, bool):
        if plain and flipped:
            return (f"its {up} {list(up_shape)} and {DOWN} {list(down_shape)} fit both [E, out, in] and [E, in, out] "
                    f"storage, and the module does not say which (is_transposed)")
        transposed = flipped
    concatenated = getattr(module, "is_concatenated", None)
    if not isinstance(concatenated, bool):
        if gated and not type(module).__module__.startswith(_CONVENTION_PACKAGES):
            return (f"whether its {up} holds gate | up concatenated or interleaved per unit is not recorded on the "
                    f"module (transformers' @use_experts_implementation sets is_concatenated)")
        concatenated = True
    if getattr(module, "has_post_expert_norm", False):
        return "it normalises each expert's output (post_expert_norm), which needs the whole sum of the split units"
    biases = tuple(name for name in (f"{up}_bias", f"{DOWN}_bias") if name in params)
    # Submodules' too: a per-expert norm of each expert's output (Ergo's post_expert_norm module) needs the whole
    # sum of the split units, which each rank's partial sum is not.
    others = sorted({name for name, _ in module.named_parameters()} - {up, DOWN, *biases})
    if others:
        return (f"it holds parameters besides its experts' weights and biases ({', '.join(others)}), which its forward "
                f"may apply to each expert's whole output")
    intermediate = down_shape[1] if transposed else down_shape[2]
    return ExpertsLayout(up, gated, transposed, concatenated, up_shape[0], intermediate, biases)


def find_experts(module: nn.Module) -> dict[str, ExpertsLayout | str]:
    """Every grouped-experts module under ``module``: FQN -> its layout, or why it cannot be split."""
    found: dict[str, ExpertsLayout | str] = {}
    for name, sub in module.named_modules():
        if any(name.startswith(f"{outer}.") for outer, layout in found.items() if not isinstance(layout, str)):
            continue  # inside experts already found (DBRX's block holds the experts module holding the weights)
        layout = experts_layout(sub)
        if layout is not None:
            found[name] = layout
    return found


def check_experts(fqn: str, module: nn.Module, tp_size: int) -> ExpertsLayout | ProjectionPairLayout | FlatExpertsLayout:
    """The layout of ``module`` (style ``experts``), checked to split ``tp_size`` ways.

    Raises:
        TypeError: ``module`` holds no grouped experts.
        ValueError: Its layout cannot be split (the reason), or its hidden units do not divide by ``tp_size``.
    """
    layout = experts_layout(module)
    if layout is None:
        raise TypeError(
            f"{fqn}: style 'experts' needs a module holding grouped experts (3-D gate_up_proj or up_proj, and "
            f"down_proj), got {type(module).__name__}."
        )
    if isinstance(layout, str):
        raise ValueError(f"{fqn}: its experts cannot be split over tensor-parallel ranks: {layout}. Leave {fqn} replicated in the plan.")
    if layout.intermediate % tp_size:
        raise ValueError(
            f"{fqn}: each expert's {layout.intermediate} hidden units are not divisible by tensor_parallel_size={tp_size}. "
            f"Choose a tensor_parallel_size that divides {layout.intermediate}, or leave {fqn} replicated in the plan."
        )
    return layout


def split_experts(fqn: str, module: nn.Module, layout: ExpertsLayout | ProjectionPairLayout | FlatExpertsLayout, tp_mesh: Any) -> dict[str, fused_layout.FusedLayout]:
    """Shard ``module``'s experts over ``tp_mesh`` and make its forward compute this rank's partial sum.

    Returns the fused layouts of the parameters reordered rank-major (to be marked after sharding, so that
    state dicts stay in the module's own order).
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    if isinstance(layout, ProjectionPairLayout):
        split_projection_pair(module, layout, tp_mesh)  # marks its own fused layout on the opening projection
        return {}
    if isinstance(layout, FlatExpertsLayout):
        split_flat_experts(module, layout, tp_mesh)  # marks its own fused layouts on the parameters' modules
        return {}
    tp_size = tp_mesh.size()
    layouts: dict[str, fused_layout.FusedLayout] = {}
    for name, dim in layout.split_dims().items():
        param = module._parameters[name]
        blocks = layout.fused_blocks()
        if blocks is not None and name.startswith(layout.up):
            layouts[name] = fused_layout.FusedLayout(dim, blocks, tp_size)
            fused_layout.rank_major_rows(param, layouts[name])
        placed = distribute_tensor(param.detach(), tp_mesh, [Shard(dim)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
    # During the call the forward reads this rank's slices; named_parameters and state_dict keep the DTensors.
    sliced = LocalView(tuple(layout.split_dims()))
    module.register_forward_pre_hook(sliced.enter)
    module.register_forward_hook(sliced.leave, always_call=True)
    region = _ExpertsRegion(tp_mesh, f"{DOWN}_bias" if f"{DOWN}_bias" in layout.biases else None)
    module.register_forward_pre_hook(region.enter, with_kwargs=True)
    module.register_forward_hook(region.leave, always_call=True)
    # The down bias's gradient is a partial sum over the group: reduced with the split regions' parameters.
    if region.down_bias is not None:
        module._split_region_parameters = PartialSumParameters(tp_mesh.get_group(), fqn, lambda: [module._parameters[region.down_bias]])
    return layouts


class _ExpertsRegion:
    """The hooks around one split experts module's forward (see the module docstring)."""

    def __init__(self, mesh: Any, down_bias: str | None) -> None:
        self.mesh, self.down_bias = mesh, down_bias

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.down_bias is not None:
            # Read as an instance attribute (found before _parameters), as LocalView's slices are.
            module.__dict__[self.down_bias] = module._parameters[self.down_bias] / self.mesh.size()
        return tuple(gradient_summed(a, self.mesh) for a in args), {k: gradient_summed(v, self.mesh) for k, v in kwargs.items()}

    def leave(self, module: nn.Module, _: tuple[Any, ...], output: Any) -> Any:
        if self.down_bias is not None:
            module.__dict__.pop(self.down_bias, None)
        return _all_reduced(output, self.mesh) if isinstance(output, Tensor) else output


def _all_reduced(partial: Tensor, mesh: Any) -> Tensor:
    """Every rank's partial sum, summed (forward); the replicated gradient passed through (backward)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()

