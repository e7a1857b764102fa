"""The expert weights' gradients, reduced once per optimizer step over the ranks that hold the same experts.

After backward, the rank holding an expert has the sum of the gradients of every token routed to it from its
expert-parallel group (each token's loss term is its own rank's batch mean). Data parallelism averages the dense
gradients over all ``dp`` ranks; the experts' must be the same average: summed over the ranks holding the same
experts (the other ``ep`` groups, ``dp / ep`` of them) and divided by ``dp`` — not by ``dp / ep``, which would make
them ``ep`` times too large (pytorch#160285). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.parallelize.data.grad_sync import all_reduce_flat


def reduce_expert_gradients(
    parameters: Iterable[nn.Parameter], replicas: dist.ProcessGroup | None, data_parallel_size: int
) -> int:
    """Sum expert gradients over ``replicas`` (``None``: no other rank holds these experts) and divide by
    ``data_parallel_size``. An expert no token reached gets a zero gradient. Returns the bytes sent."""
    grads = []
    for param in parameters:
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    if replicas is None:
        for grad in grads:
            grad.div_(data_parallel_size)
        return 0
    return all_reduce_flat(grads, replicas, dist.ReduceOp.SUM, divide_by=data_parallel_size)
