"""What crosses a pipeline stage boundary is contiguous: activations sent forward, gradients sent back.

torch's pipeline stages send activations and gradients with ``isend``/``irecv``, which need contiguous
tensors (gloo refuses others: "input tensor has to be contiguous"). A traced stage can return a
non-contiguous value — an attention mask built with ``expand`` (stride 0) that the next stage's blocks
need again, a transposed activation — and its receive buffers are allocated with the traced strides, so
both ends would be non-contiguous. The gradient a stage computes for a received activation has whatever
layout autograd produced (the transpose of a product, say), and the zero-bubble schedules send it as it is.

So every value a stage sends is made contiguous in its graph (and the receiving stage's placeholder is
recorded with contiguous strides, which is what its receive buffer is allocated with), and every received
activation passes through an identity whose backward makes the gradient contiguous. The math is unchanged:
only memory layouts change. No Lightning here.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.node import Node, map_arg
from torch.utils._pytree import tree_map


class _ContiguousGradient(torch.autograd.Function):
    """Identity forward; backward hands on a contiguous gradient (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx: Any, value: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def sent(value: Any) -> Any:
    """``value`` as a stage sends it: contiguous (a graph node of :func:`contiguous_boundaries`)."""
    return value.contiguous() if isinstance(value, Tensor) else value


def received(value: Any) -> Any:
    """A received activation, whose gradient (sent back) will be contiguous."""
    if isinstance(value, Tensor) and value.requires_grad:
        return _ContiguousGradient.apply(value)
    return value


def contiguous_boundaries(pipe: Any) -> None:
    """Make every activation that passes between the stages of a traced pipeline contiguous, in its graphs.

    Args:
        pipe: What ``torch.distributed.pipelining.pipeline`` returned (before any stage is built from it).
    """
    stages = dict(pipe.split_gm.named_children())
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module" and n.target in stages]
    for node in calls:
        stage_module = stages[node.target]
        placeholders = [n for n in stage_module.graph.nodes if n.op == "placeholder"]
        received_from_stage = [_produced_by_stage(arg, stages) for arg in node.args]
        # The last stage's outputs go to the loss on its own rank: no copy needed.
        changed = node is not calls[-1] and _contiguous_outputs(stage_module.graph)
        for placeholder, from_stage in zip(placeholders, received_from_stage):
            if from_stage:
                changed |= _contiguous_input(stage_module.graph, placeholder)
        if changed and hasattr(stage_module, "finalize"):  # an unflattened stage (InterpreterModule)
            stage_module.finalize()
        elif changed:
            stage_module.recompile()


def contiguous_module_boundaries(module: nn.Module) -> None:
    """The same for a stage that is a plain module (a slice of an ``nn.Sequential``): through hooks."""
    module.register_forward_pre_hook(lambda _, args: tree_map(received, args), prepend=True)
    module.register_forward_hook(lambda _, __, output: tree_map(sent, output))


def _produced_by_stage(arg: Any, stages: dict[str, nn.Module]) -> bool:
    while isinstance(arg, Node) and arg.op == "call_function" and arg.target is operator.getitem:
        arg = arg.args[0]
    return isinstance(arg, Node) and arg.op == "call_module" and arg.target in stages


def _contiguous_outputs(graph: torch.fx.Graph) -> bool:
    output = next(n for n in graph.nodes if n.op == "output")
    replaced: dict[Node, Node] = {}

    def contiguous(node: Node) -> Node:
        value = node.meta.get("val")
        # Every tensor, even one contiguous at trace time: its strides at run time may differ (a size-1 dimension
        # traced, a larger one run), and contiguous() of a contiguous tensor copies nothing.
        if not isinstance(value, Tensor):
            return node
        if node not in replaced:
            with graph.inserting_before(output):
                copy = graph.call_function(sent, (node,))
            copy.meta = {**node.meta, "val": value.contiguous()}
            replaced[node] = copy
        return replaced[node]

    output.args = map_arg(output.args, contiguous)
    return bool(replaced)


def _contiguous_input(graph: torch.fx.Graph, placeholder: Node) -> bool:
    value = placeholder.meta.get("val")
    if not isinstance(value, Tensor):
        return False
    if not value.is_contiguous():
        # The receive buffer is allocated with these strides; the sender now sends contiguous values.
        placeholder.meta["val"] = value.contiguous()
    if not value.is_floating_point():
        return False  # no gradient goes back
    users = list(placeholder.users)
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_placeholder):
        identity = graph.call_function(received, (placeholder,))
    identity.meta = dict(placeholder.meta)
    for user in users:
        user.replace_input_with(placeholder, identity)
    return True
