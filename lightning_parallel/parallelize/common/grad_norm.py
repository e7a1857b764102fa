"""Gradient-norm clipping over parameters that are partly DTensor shards and partly whole tensors.

``torch.nn.utils.clip_grad_norm_`` refuses a mix of DTensor and plain gradients (as tensor parallelism
leaves them: split layers are DTensors, norms and embeddings stay plain). Here each sharded gradient
contributes its shard's share, summed over its mesh, and each whole gradient counts once — the norm of
the full, unsplit gradient — and the scaling rule is torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate


def total_grad_norm(
    parameters: Iterable[Tensor],
    norm_type: float = 2.0,
    sum_over: dist.ProcessGroup | None = None,
    divided: tuple[Iterable[Tensor], dist.ProcessGroup] | None = None,
) -> Tensor:
    """The ``norm_type`` norm of all gradients together, as one device would compute it unsplit.

    Args:
        parameters: This rank's parameters.
        norm_type: As in ``torch.nn.utils.clip_grad_norm_``.
        sum_over: A group whose ranks hold *different* parameters (pipeline stages): their shares are
            combined, so every rank gets the norm of the whole model.
        divided: ``(some of parameters, group)``: those are held by one rank of ``group`` each, the others holding
            other ones in their place (experts kept as an ``nn.ModuleList`` divided by expert parallelism): their
            shares are combined over ``group``, the other parameters' not.
    """
    parameters = list(parameters)
    if divided is not None:
        apart, group = divided
        ids = {id(p) for p in apart}
        share = total_grad_norm([p for p in parameters if id(p) in ids], norm_type)
        share = share if math.isinf(norm_type) else share**norm_type
        dist.all_reduce(share, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
        rest = total_grad_norm([p for p in parameters if id(p) not in ids], norm_type, sum_over)
        if math.isinf(norm_type):
            return torch.maximum(rest, share.to(rest.device))
        return (rest**norm_type + share.to(rest.device)) ** (1.0 / norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                # Unreduced sums: reduce them first, or the shares would not add up to the true gradient.
                grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            local = _local_norm_term(grad.to_local(), norm_type)
            for mesh_dim, placement in enumerate(grad.placements):
                # Anything neither replicated nor partial is a shard (FSDP over TP uses strided shards).
                if not placement.is_replicate():
                    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
                    dist.all_reduce(local, op=op, group=grad.device_mesh.get_group(mesh_dim))
        else:
            local = _local_norm_term(grad, norm_type)
        total = torch.maximum(total, local) if math.isinf(norm_type) else total + local
    if sum_over is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=sum_over)
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    exclude_from_norm: Iterable[Tensor] = (),
    sum_over: dist.ProcessGroup | None = None,
    divided: tuple[Iterable[Tensor], dist.ProcessGroup] | None = None,
) -> Tensor:
    """Scale gradients in place so that their total norm is at most ``max_norm``; returns the norm before.

    ``exclude_from_norm`` are scaled but not counted (copies of tied weights another rank counts);
    ``sum_over`` and ``divided`` as in :func:`total_grad_norm`.
    """
    parameters = [p for p in parameters if p.grad is not None]
    excluded = {id(p) for p in exclude_from_norm}
    norm = total_grad_norm([p for p in parameters if id(p) not in excluded], norm_type, sum_over, divided)
    # Same rule as torch.nn.utils.clip_grad_norm_.
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in parameters:
        p.grad.mul_(coefficient.to(dtype=p.grad.dtype).item())
    return norm


def _local_norm_term(tensor: Tensor, norm_type: float) -> Tensor:
    values = tensor.detach().to(torch.float64).abs()
    if math.isinf(norm_type):
        return values.max() if values.numel() else torch.zeros((), dtype=torch.float64)
    return (values**norm_type).sum()


def clip_optimizer_grad_norm(
    optimizer: torch.optim.Optimizer, clip_val: float, divided: tuple[Iterable[Tensor], dist.ProcessGroup] | None = None
) -> None:
    """Clip the gradients of ``optimizer``'s parameters (the signature of Lightning's ``clip_grad_by_norm``;
    ``divided`` as in :func:`total_grad_norm`)."""
    clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], clip_val, divided=divided)
