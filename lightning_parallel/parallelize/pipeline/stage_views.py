"""Views in traced stages that run on DTensors: export's views assume the trace's memory layout.

torch.export records a ``reshape`` (or ``flatten``, ``view``) of a tensor that was contiguous at trace time
as ``aten.view``, and drops a ``contiguous()`` that copied nothing there: facts about the strides of the
*whole* tensors the trace saw. A tensor-parallel stage runs the same graph in DTensor's global view
(:mod:`lightning_parallel.parallelize.pipeline.stage_tensor`), where each rank's local tensor has the layout of the
kernels and redistributions that actually ran — a shard split out of a replicated tensor is a fresh
contiguous copy, and a CPU attention kernel returns its output in its query's layout — while the DTensor
still reports the trace's strides. A later ``view`` of such a tensor (merging heads back with
``transpose(1, 2).reshape(B, L, -1)``, as every Llama-style attention does) then fails on the local tensor
with "view size is not compatible with input tensor's size and stride". (A ``reshape`` — kept as such in
the graph — fails the same way: on the DTensor it decides from the reported strides, and becomes a view.)

So in those stages every op that views its input (``view``, ``reshape``, ``flatten``, ..., and ``linear`` or
``matmul``, which view a batched input as a matrix) first makes the
input's local tensor contiguous where it is not (a copy of this rank's part; contiguous ones, the common
case, are viewed as before). Values are unchanged. Only a view that shares memory with something written in
place must stay a true view (the write has to show through it): those are left alone. No Lightning here.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.fx import Graph, Node

aten = torch.ops.aten


#: Ops whose local kernel views its input (``reshape`` decomposes into ``view`` wherever the strides the
#: DTensor reports allow one; ``linear`` and ``matmul`` decompose on DTensors into a ``view`` of a batched input
#: as a matrix: a projection reading the transposed output of a channel-split convolution, ``(C·conv(B·x))ᵀ``,
#: whose local tensor is transposed while the DTensor reports contiguous strides).
_VIEWING = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.view_as.default,
    aten.reshape_as.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.linear.default,
    aten.matmul.default,
)


def contiguous_before_views(stage_module: nn.Module) -> None:
    """Pass the input of every viewing op in ``stage_module``'s traced graphs through :func:`contiguous_local`."""
    from torch.export.unflatten import InterpreterModule

    for submodule in stage_module.modules():
        if isinstance(submodule, InterpreterModule) and _rewrite(submodule.graph):
            submodule.finalize()


def contiguous_local(value: Tensor) -> Tensor:
    """``value``, with its local tensor copied into a contiguous one if it is a DTensor whose local tensor is not."""
    if not isinstance(value, DTensor) or value.to_local().is_contiguous():
        return value
    # to_local/from_local are differentiable: the gradient reaches ``value`` with its own placements.
    local = value.to_local().contiguous()
    stride = _contiguous_strides(value.shape)
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=stride)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _rewrite(graph: Graph) -> bool:
    written = _written_aliases(graph)
    viewing = [
        n for n in graph.nodes
        if n.op == "call_function" and n.target in _VIEWING and n not in written and isinstance(n.args[0], Node)
        and n.args[0].target is not contiguous_local  # rewritten already
    ]
    for node in viewing:
        with graph.inserting_before(node):
            contiguous = graph.call_function(contiguous_local, (node.args[0],))
        contiguous.meta = dict(node.args[0].meta)
        node.args = (contiguous, *node.args[1:])
    return bool(viewing)


def _written_aliases(graph: Graph) -> set[Node]:
    """Nodes that share memory (through view ops) with a tensor some op of the graph writes in place."""
    parent: dict[Node, Node] = {}

    def root(node: Node) -> Node:
        while parent.get(node, node) is not node:
            node = parent[node]
        return node

    written: list[Node] = []
    for node in graph.nodes:
        base = _aliased_input(node)
        if base is not None:
            parent[root(node)] = root(base)
        written.extend(_written_inputs(node))
    written_roots = {root(node) for node in written}
    return {node for node in graph.nodes if root(node) in written_roots}


def _aliased_input(node: Node) -> Node | None:
    """The input ``node``'s result is a view of (view ops, and items of ``split``/``chunk`` results)."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, Node) and _aliased_input(source) is not None else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return None
    aliased = {a.name for a in schema.arguments if a.alias_info is not None and not a.alias_info.is_write}
    for argument, value in zip(schema.arguments, node.args):
        if argument.name in aliased and isinstance(value, Node):
            return value
    return None


def _written_inputs(node: Node) -> list[Node]:
    """The inputs an op writes in place (``add_``, ``copy_``, ``out=``)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.kwargs.get(argument.name) if argument.kwarg_only or index >= len(node.args) else node.args[index]
        if isinstance(value, Node):
            written.append(value)
    return written
