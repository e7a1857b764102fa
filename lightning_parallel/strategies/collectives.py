"""Collectives of the engine: over the data-parallel group by default, world-wide where ranks must agree."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from torch.distributed.tensor import DTensor


def is_dry_run() -> bool:
    """Whether this process is one simulated rank of a dry run (torch's ``fake`` process-group backend).

    Collectives there move nothing: a decision rank 0 would broadcast is taken by every simulated rank itself
    (deterministically the same), and object collectives return this rank's own object.
    """
    return dist.is_initialized() and dist.get_backend() == "fake"


def whole(value: Any) -> Any:
    """A DTensor's whole value as an ordinary tensor (differentiable); anything else unchanged.

    Under a ``loss_parallel`` head the loss computed in ``training_step`` is a (replicated) DTensor: what
    is logged, returned or gathered from it must be an ordinary tensor again.
    """
    return value.full_tensor() if isinstance(value, DTensor) else value


class GroupCollectivesMixin:
    """Lightning's collective hooks for a strategy that has ``data_parallel_group``, ``root_device`` and
    ``world_size`` (mixed into :class:`~lightning_parallel.strategies.engine.ParallelEngineStrategy`)."""

    def _before_collective(self, name: str) -> None:
        """Called before each of these collectives (the engine records it for a hang's report)."""

    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce ``tensor`` over ``group``; by default over this rank's data-parallel replicas.

        This is what ``self.log(..., sync_dist=True)`` uses: tensor- and pipeline-parallel peers hold the
        same samples, so averaging over them would count samples several times.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        self._before_collective("reduce")
        tensor = whole(tensor)
        return _sync_ddp_if_available(tensor, group if group is not None else self.data_parallel_group, reduce_op=reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` from every data-parallel replica (or from ``group``)."""
        self._before_collective("all_gather")
        return _all_gather_ddp_if_available(
            whole(tensor), group=group if group is not None else self.data_parallel_group, sync_grads=sync_grads
        )

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Decisions (stop early, save a checkpoint) must agree on every rank of the world, not one group.
        self._before_collective("reduce_boolean_decision")
        votes = _sync_ddp_if_available(torch.tensor(int(decision), device=self.root_device), None, reduce_op=ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        self._before_collective(f"barrier {name}" if name else "barrier")
        collectives.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized() or is_dry_run():
            return obj
        self._before_collective("broadcast")
        holder = [obj]
        collectives.broadcast_object_list(holder, src)
        return holder[0]

from lightning_parallel import collectives
