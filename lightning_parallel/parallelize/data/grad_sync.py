"""Gradient reductions a pipeline needs at the optimizer step: tied weights summed, replicas averaged.

Pipeline stages are not wrapped in DDP: DDP (and FSDP) inside torch's schedules synchronize after every
schedule step, which under gradient accumulation would communicate once per micro-step. Instead the
strategy calls these once, after the last accumulated backward.

Gradients are reduced in buckets of :data:`BUCKET_BYTES`, as DDP does (its default ``bucket_cap_mb=25``): one
all-reduce per bucket, so the number of collectives follows the model's size in bytes, not its number of
parameters, and no flat copy larger than a bucket is made (a gradient larger than a bucket is reduced in place,
on its own). Unlike DDP's they start after backward, not during it: gradients are final only in the last
micro-batch backward of the last accumulated step, which runs inside torch's schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel import collectives

#: Bytes of gradients reduced by one all-reduce (DDP's default bucket size).
BUCKET_BYTES = 25 * 1024 * 1024


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
    """Average gradients over data-parallel replicas: one all-reduce per bucket. Returns the bytes sent.

    Parameters without a gradient are skipped, as DDP with ``find_unused_parameters`` would; every
    replica holds the same stages, so they agree on which those are. DTensor gradients (tensor-parallel
    stages) average their local parts: the replicas hold the same parts.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    return all_reduce_flat(grads, group, dist.ReduceOp.SUM, divide_by=dist.get_world_size(group))


def all_reduce_flat(
    grads: list[Tensor], group: dist.ProcessGroup, op: dist.ReduceOp, divide_by: int, bucket_bytes: int = BUCKET_BYTES
) -> int:
    """Reduce ``grads`` in place over ``group`` (one collective per bucket of ``bucket_bytes`` of one dtype), then
    divide by ``divide_by``.

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
        for bucket in _buckets(same_kind, bucket_bytes):
            alone = len(bucket) == 1 and bucket[0].is_contiguous()
            # A lone contiguous gradient is reduced where it is; several share one flat buffer.
            flat = bucket[0].view(-1) if alone else torch.cat([g.reshape(-1) for g in bucket])
            collectives.all_reduce(flat, op=op, group=group)
            if divide_by != 1:
                flat.div_(divide_by)
            if not alone:
                offset = 0
                for grad in bucket:
                    grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
            sent += flat.numel() * flat.element_size()
    return sent


def _buckets(grads: list[Tensor], bucket_bytes: int) -> Iterator[list[Tensor]]:
    """``grads`` in order, in runs of at most ``bucket_bytes`` (a larger gradient is a run of its own)."""
    bucket: list[Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        yield bucket
