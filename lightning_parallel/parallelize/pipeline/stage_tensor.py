"""Tensor parallelism inside traced pipeline stages: parameters become DTensors, the graph runs on DTensors.

A traced stage is an ATen graph: its layers are no longer ``nn.Linear`` modules that ``parallelize_module``
could rewrite, and export baked the whole (unsplit) shapes into its reshapes. So instead of local shards
with hooks, the stage runs in DTensor's global view: each parameter is placed by the plan (column-wise:
``Shard(0)``; row-wise: weight ``Shard(1)``, bias replicated; vocabulary-parallel embedding: ``Shard(0)``;
everything else replicated), the stage's inputs enter as replicated DTensors, DTensor's sharding propagation
runs every op (reshapes into heads keep their global shapes; split matmuls produce shards and partial sums,
reduced where an op needs whole values), and the outputs leave as whole tensors for the next stage. The
math is the unsplit model's by construction. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._pytree import tree_map

import lightning_parallel.parallelize.tensor.dtensor_ops  # noqa: F401  (CPU attention rules for DTensor)
from lightning_parallel.parallelize.pipeline.stage_views import contiguous_before_views
from lightning_parallel.parallelize.tensor.plan import ResolvedPlan
from lightning_parallel.parallelize.tensor.vocabulary import aten_split_lookup, replicate_partials

#: Placement of each parameter of a module, by style; anything not listed is replicated. Fused projections
#: are split along their output features in the module's own order: in the global view DTensor slices
#: q, k and v (a short convolution's B, C and x) out of the sharded output itself (gathering where a slice
#: crosses ranks). A depthwise convolution's weight ``[channels, 1, kernel]`` and bias split over the channels.
_COLUMN = {"weight": Shard(0), "bias": Shard(0)}
_PLACEMENTS: dict[str, dict[str, Placement]] = {
    "colwise": _COLUMN,
    "colwise_gather_output": _COLUMN,
    "fused_qkv": _COLUMN,
    "fused_gate_up": _COLUMN,
    "fused_blocks": _COLUMN,
    "channelwise": _COLUMN,
    "rowwise": {"weight": Shard(1)},
    "embedding_rowwise": {"weight": Shard(0)},
}
#: transformers' ``Conv1D`` stores its weight ``[in, out]``: the weight's split dimension is the other one.
_CONV1D_WEIGHT = {Shard(0): Shard(1), Shard(1): Shard(0)}
#: Styles whose meaning cannot be kept inside a traced stage.
_UNSUPPORTED = {
    "loss_parallel": "the loss runs on whole logits after the last stage; use 'colwise' or 'replicate' for the head",
}


@dataclass(frozen=True)
class StageTensorParallel:
    """Places stage parameters on the ``tp`` mesh by plan and runs stages in DTensor's global view.

    Attributes:
        mesh: The 1-D tensor-parallel mesh.
        styles: Module name (relative to the pipelined module) -> style.
        conv1d: Names (relative) of split modules that are transformers' ``Conv1D``.
    """

    mesh: DeviceMesh
    styles: Mapping[str, str]
    conv1d: frozenset[str] = frozenset()
    owned_elsewhere: frozenset[str] = frozenset()

    @classmethod
    def from_plan(
        cls, resolved: ResolvedPlan, root_name: str, mesh: DeviceMesh, owned_elsewhere: Collection[str] = ()
    ) -> StageTensorParallel:
        """Bind a plan resolved on the LightningModule to the pipelined submodule ``root_name``.

        ``owned_elsewhere``: modules (names relative to the LightningModule) whose parameters another parallelism
        places (routed experts divided by expert parallelism): they stay plain tensors here, not DTensors on ``tp``.

        Raises:
            ValueError: A style cannot run inside a stage, or a split module lies outside the pipelined module.
        """
        prefix = f"{root_name}." if root_name else ""
        styles: dict[str, str] = {}
        # Names of the model as it is: a projection wrapped with adapters places its base layer and adapters.
        for fqn, style in resolved.module_styles().items():
            if style in _UNSUPPORTED:
                raise ValueError(f"Plan entry {fqn!r}: style {style!r} is not supported with pipeline parallelism ({_UNSUPPORTED[style]}).")
            if style == "replicate":
                continue
            if not fqn.startswith(prefix):
                raise ValueError(
                    f"Plan entry {fqn!r} ({style}) is outside {root_name!r}, the module the pipeline cuts into stages; "
                    f"under pipeline parallelism only its layers can be split. Leave {fqn} replicated."
                )
            styles[fqn[len(prefix) :]] = style
        conv1d = frozenset(
            (f"{fqn}.{resolved.wrapped[fqn].base}" if fqn in resolved.wrapped else fqn)[len(prefix) :]
            for fqn in resolved.conv1d if fqn.startswith(prefix))
        owned = frozenset(fqn[len(prefix) :] for fqn in owned_elsewhere if fqn.startswith(prefix))
        return cls(mesh, styles, conv1d, owned)

    def places(self, name: str) -> bool:
        """Whether the parameter ``name`` (relative to the pipelined module) becomes a DTensor on the ``tp`` mesh:
        not where a module another parallelism owns holds it."""
        return not any(name.startswith(f"{owner}.") for owner in self.owned_elsewhere)

    def placement(self, name: str) -> Placement:
        """Where the parameter ``name`` (relative to the pipelined module) lives on the mesh."""
        module_name, _, attribute = name.rpartition(".")
        placement = _PLACEMENTS.get(self.styles.get(module_name, ""), {}).get(attribute, Replicate())
        if attribute == "weight" and module_name in self.conv1d:
            return _CONV1D_WEIGHT.get(placement, placement)
        return placement

    def distribute(self, name: str, param: Tensor) -> nn.Parameter:
        """A DTensor parameter holding this rank's part of ``param`` (every rank passes the same values)."""
        placed = distribute_tensor(param.detach(), self.mesh, [self.placement(name)], src_data_rank=None)
        return nn.Parameter(placed, requires_grad=param.requires_grad)

    def wrap(self, stage_module: nn.Module) -> None:
        """Inputs enter ``stage_module`` as replicated DTensors; its outputs leave as whole tensors."""
        stage_module.register_forward_pre_hook(self._inputs_to_dtensor, with_kwargs=True)
        stage_module.register_forward_hook(self._outputs_to_whole)
        _lookups_of_own_rows(stage_module)
        _reduce_where_computed(stage_module)
        if "channelwise" in self.styles.values():
            _convolutions_over_local_channels(stage_module)
        contiguous_before_views(stage_module)  # local shards' strides are not the trace's

    def context(self) -> AbstractContextManager[Any]:
        """Run stages (forward and backward) in this: tensors the graph creates (positions, masks) count as replicated."""
        return implicit_replication()

    def _inputs_to_dtensor(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        def to_dtensor(value: Any) -> Any:
            if isinstance(value, Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, self.mesh, [Replicate()], run_check=False)
            return value

        return tree_map(to_dtensor, args), tree_map(to_dtensor, kwargs)

    @staticmethod
    def _outputs_to_whole(_: nn.Module, __: Any, output: Any) -> Any:
        def to_whole(value: Any) -> Any:
            if isinstance(value, DTensor):
                # A copy, not to_local()'s view of the DTensor's storage: the zero-bubble schedules detach
                # stage outputs in place after the input-gradient pass, which views do not allow.
                return value.redistribute(placements=[Replicate()] * value.device_mesh.ndim).to_local().clone()
            return value

        return tree_map(to_whole, output)


#: ATen ops whose output is a partial sum when they contract a split dimension: a row-wise projection's matmul
#: (its input split over the features, its weight over its columns) and a lookup in a vocabulary-split table.
_PARTIAL_PRODUCERS = (
    torch.ops.aten.embedding.default,
    aten_split_lookup,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.matmul.default,
    torch.ops.aten.linear.default,
)


def _lookups_of_own_rows(stage_module: nn.Module) -> None:
    """Run every lookup of ``stage_module``'s graphs through :func:`aten_split_lookup`: in a vocabulary-split table, its
    backward computes this rank's rows of the gradient, not the whole table's that DTensor's ``aten.embedding``
    backward gives (tp times the rank's rows, on every rank, at the end of every backward). Any other lookup runs as
    traced."""
    from torch.export.unflatten import InterpreterModule

    for submodule in stage_module.modules():
        if not isinstance(submodule, InterpreterModule):
            continue
        lookups = [n for n in submodule.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.embedding.default]
        for node in lookups:
            node.target = aten_split_lookup
        if lookups:
            submodule.finalize()


def _reduce_where_computed(stage_module: nn.Module) -> None:
    """Reduce partial sums right where they are computed, as eager TP does (a row-wise layer's output hook).

    Left to DTensor, a row-wise projection's output stays a partial sum through the residual add, and the next
    norm reduces it in its forward; but autograd saves the norm's *unreduced* input, so its backward all-reduces
    it again (one extra activation-sized all-reduce per norm behind a row-wise layer: 7 instead of 4 per
    micro-batch for two blocks). A vocabulary-split lookup must be reduced at once anyway: the mask DTensor keeps
    for it lasts only until the next op, and ops that pass it on (dtype casts, scaling) lose it.
    """
    from torch.export.unflatten import InterpreterModule

    for submodule in stage_module.modules():
        if not isinstance(submodule, InterpreterModule):
            continue
        graph = submodule.graph
        producers = [n for n in graph.nodes if n.op == "call_function" and n.target in _PARTIAL_PRODUCERS]
        for producer in producers:
            with graph.inserting_after(producer):
                reduced = graph.call_function(replicate_partials, (producer,))
            producer.replace_all_uses_with(reduced, delete_user_cb=lambda user, reduced=reduced: user is not reduced)
            reduced.meta = dict(producer.meta)
        if producers:
            submodule.finalize()


#: ATen convolutions (``groups`` is their last argument) and what runs them on channel-split weights.
_CONVOLUTIONS = (
    torch.ops.aten.conv1d.default,
    torch.ops.aten.conv2d.default,
    torch.ops.aten.conv3d.default,
    torch.ops.aten.convolution.default,
)


def channelwise_convolution(op: Any, input: Any, weight: Any, bias: Any, *rest: Any) -> Any:
    """``op(input, weight, bias, *rest)`` (an ATen convolution, ``groups`` last in ``rest``); where ``weight`` is a
    depthwise convolution's weight split over its channels (``Shard(0)``), each rank convolves its own channels.

    The input is split along its channel dimension (free where it is replicated), the local convolution runs with
    ``groups / tp`` (each rank's channels convolved alone, as the whole convolution does), and the output is split
    along its channels. Autograd runs through ``to_local``/``from_local``: the weight's and bias's gradients are
    their shards (a channel is computed on one rank only, nothing is summed) and the input's gradient is split like
    the input. Any other convolution runs as traced.
    """
    if not (isinstance(weight, DTensor) and weight.placements == (Shard(0),)):
        return op(input, weight, bias, *rest)
    mesh, groups = weight.device_mesh, rest[-1]
    if groups != weight.shape[0] or groups % mesh.size():
        raise ValueError(
            f"A convolution of groups={groups} reads a weight of shape {tuple(weight.shape)} split over its channels "
            f"(style 'channelwise'): only a depthwise convolution (groups = channels, divisible by "
            f"tensor_parallel_size={mesh.size()}) can run on a rank's channels. Leave it replicated in the plan."
        )
    channel_dim = input.dim() - weight.dim() + 1  # [B, C, *spatial], or unbatched [C, *spatial]
    if not isinstance(input, DTensor):
        input = DTensor.from_local(input, mesh, [Replicate()], run_check=False)
    local_bias = None if bias is None else bias.redistribute(placements=[Shard(0)]).to_local()
    local = op(input.redistribute(placements=[Shard(channel_dim)]).to_local(), weight.to_local(), local_bias,
               *rest[:-1], groups // mesh.size())
    return DTensor.from_local(local, mesh, [Shard(channel_dim)], run_check=False)


def _convolutions_over_local_channels(stage_module: nn.Module) -> None:
    """Route every convolution of ``stage_module``'s graphs through :func:`channelwise_convolution`."""
    from torch.export.unflatten import InterpreterModule

    for submodule in stage_module.modules():
        if not isinstance(submodule, InterpreterModule):
            continue
        graph = submodule.graph
        convolutions = [n for n in graph.nodes if n.op == "call_function" and n.target in _CONVOLUTIONS]
        for node in convolutions:
            schema = node.target._schema
            args = [*node.args, *(node.kwargs.get(a.name, a.default_value) for a in schema.arguments[len(node.args):])]
            with graph.inserting_after(node):
                local = graph.call_function(channelwise_convolution, (node.target, *args))
            node.replace_all_uses_with(local)
            local.meta = dict(node.meta)
            graph.erase_node(node)
        if convolutions:
            submodule.finalize()
