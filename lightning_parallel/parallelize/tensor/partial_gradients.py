"""Autograd helpers for regions whose gradients are partial sums over the tensor-parallel group.

A replicated computation used on this rank's slice of heads (or hidden units) gets, on each rank, only the part of
its gradient that this rank's slice contributes. :func:`gradient_summed` marks where such partial gradients must be
summed into the whole one (an all-reduce in backward); :class:`ScaleGradient` turns a whole gradient into a rank's
share of it (``1/tp``), so that it can be summed with partial ones. No Lightning here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def gradient_summed(value: Any, mesh: Any) -> Any:
    """A floating tensor that needs a gradient, as itself in forward, with its gradient summed over ``mesh`` in
    backward (each rank's is a partial sum); anything else unchanged."""
    if not isinstance(value, Tensor) or not value.is_floating_point() or not value.requires_grad:
        return value
    from torch.distributed.tensor import DTensor, Partial, Replicate

    # to_local(grad_placements=Partial) declares this rank's gradient a partial sum; from_local's backward
    # then all-reduces it into the replicated input's whole gradient.
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class ScaleGradient(torch.autograd.Function):
    """Identity in forward; the gradient times ``factor`` in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None
