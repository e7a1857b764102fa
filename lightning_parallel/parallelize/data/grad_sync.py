"""Gradient reductions a pipeline needs at the optimizer step: tied weights summed, replicas averaged.

Pipeline stages are not wrapped in DDP: DDP (and FSDP) inside torch's schedules synchronize after every
schedule step, which under gradient accumulation would communicate once per micro-step. Instead the
strategy calls these once, after the last accumulated backward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def sum_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> int:
    """Sum the gradients of copies of the same weights held by the ranks of ``group`` (tied weights).

    A copy that got no gradient contributes zeros. Returns the bytes sent.
    """
    grads = []
    for param in parameters:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    return all_reduce_flat(grads, group, dist.ReduceOp.SUM, divide_by=1)


def average_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> int:
    """Average gradients over data-parallel replicas: one all-reduce per dtype. Returns the bytes sent.

    Parameters without a gradient are skipped, as DDP with ``find_unused_parameters`` would; every
    replica holds the same stages, so they agree on which those are. DTensor gradients (tensor-parallel
    stages) average their local parts: the replicas hold the same parts.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    return all_reduce_flat(grads, group, dist.ReduceOp.SUM, divide_by=dist.get_world_size(group))


def all_reduce_flat(grads: list[Tensor], group: dist.ProcessGroup, op: dist.ReduceOp, divide_by: int) -> int:
    """Reduce ``grads`` in place over ``group`` (one collective per dtype), then divide by ``divide_by``.

    DTensor gradients reduce their local part. Returns the bytes sent.
    """
    sent = 0
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise RuntimeError("Partial-sum DTensor gradients must be reduced over their mesh before the replicas average them.")
            grad = grad._local_tensor  # the part this rank holds; updated in place below
        by_kind.setdefault((grad.dtype, grad.device), []).append(grad)
    for same_kind in by_kind.values():
        # One flat buffer per dtype: a single collective instead of one per parameter.
        flat = torch.cat([g.reshape(-1) for g in same_kind])
        dist.all_reduce(flat, op=op, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        offset = 0
        for grad in same_kind:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        sent += flat.numel() * flat.element_size()
    return sent
