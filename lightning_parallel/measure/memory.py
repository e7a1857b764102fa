"""What one rank holds of the training state: parameters, gradients and optimizer state, in bytes.

Counted from local storage: a DTensor (tensor-parallel split, FSDP shard) counts the part on this rank,
a parameter of another pipeline stage (``None`` here) counts nothing, and a tensor shared by two names
(tied weights) counts once. This is the figure that decides whether a layout fits in device memory.
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state held by one rank."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def local_bytes(tensor: Tensor | None) -> int:
    """Bytes of ``tensor`` stored on this rank (a DTensor's local part)."""
    if tensor is None:
        return 0
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def local_rows(tensor: Tensor) -> int:
    """Rows (dim 0) of ``tensor`` on this rank (a DTensor's local part; 1 for a scalar): what FSDP2 divides."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.shape[0] if local.dim() else 1


def state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> StateBytes:
    """Parameter, gradient and optimizer-state bytes of ``module`` on this rank (see module doc)."""
    params = list(module.parameters())  # de-duplicated: tied weights once
    states = [value for optimizer in optimizers for per_param in optimizer.state.values() for value in per_param.values()]
    return StateBytes(
        parameters=sum(local_bytes(p) for p in params),
        gradients=sum(local_bytes(p.grad) for p in params),
        optimizer=sum(local_bytes(v) for v in states if isinstance(v, Tensor)),
    )
