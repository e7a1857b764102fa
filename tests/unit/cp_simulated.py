"""Context-parallel ranks simulated in one process: one thread per rank, the library's collectives over a barrier.

Ring attention and the sequence split decide per rank in Python (which blocks to skip, which chunks to keep), so
the ranks cannot share one program as ``LocalTensorMode`` runs them. Here each rank runs its own code on its own
thread; :mod:`lightning_parallel.collectives`' functions used by context parallelism exchange tensors through
shared slots and a barrier. Nothing reaches ``torch.distributed``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel import collectives


class SimulatedGroup:
    """A group of ``size`` ranks, one thread each (the object stands for the process group)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=120)
        self._slots: list[Any] = [None] * size
        self._local = threading.local()

    @property
    def rank(self) -> int:
        return self._local.rank

    def exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (all ranks call it in the same order)."""
        self._slots[self.rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()
        return values

    def abort(self) -> None:
        self._barrier.abort()




def _reduce(values: list[Tensor], op: Any) -> Tensor:
    stacked = torch.stack(values)
    if op in ("sum", dist.ReduceOp.SUM):
        return stacked.sum(0)
    if op in ("max", dist.ReduceOp.MAX):
        return stacked.amax(0)
    if op in ("min", dist.ReduceOp.MIN):
        return stacked.amin(0)
    raise NotImplementedError(op)


def patch_collectives(monkeypatch: Any) -> None:
    """Route the collectives context parallelism uses to :class:`SimulatedGroup` (the ``group`` argument)."""

    def all_gather(tensor: Tensor, dim: int, group: SimulatedGroup) -> Tensor:
        return torch.cat(group.exchange(tensor.clone()), dim)

    def all_to_all(tensor: Tensor, output_split_sizes: Any, input_split_sizes: Any, group: SimulatedGroup) -> Tensor:
        if output_split_sizes is not None or input_split_sizes is not None:
            raise NotImplementedError("uneven all-to-all")
        parts = group.exchange(list(tensor.clone().chunk(group.size)))
        return torch.cat([parts[source][group.rank] for source in range(group.size)])

    def functional_all_reduce(tensor: Tensor, op: str, group: SimulatedGroup) -> Tensor:
        return _reduce(group.exchange(tensor.clone()), op)

    def reduce_scatter(tensor: Tensor, dim: int, group: SimulatedGroup) -> Tensor:
        return _reduce(group.exchange(tensor.clone()), "sum").chunk(group.size, dim)[group.rank].contiguous()

    def all_reduce(tensor: Tensor, op: Any = collectives.SUM, group: SimulatedGroup | None = None) -> Tensor:
        return tensor.copy_(_reduce(group.exchange(tensor.clone()), op))

    monkeypatch.setattr(collectives, "functional_all_gather", all_gather)
    monkeypatch.setattr(collectives, "functional_all_to_all_single", all_to_all)
    monkeypatch.setattr(collectives, "functional_all_reduce", functional_all_reduce)
    monkeypatch.setattr(collectives, "functional_reduce_scatter", reduce_scatter)
    monkeypatch.setattr(collectives, "all_reduce", all_reduce)
    monkeypatch.setattr(collectives, "group_device", lambda group=None: torch.device("cpu"))


def run_ranks(size: int, work: Callable[[int, SimulatedGroup], Any], monkeypatch: Any) -> list[Any]:
    """``work(rank, group)`` on ``size`` threads at once; their results by rank (the first failure re-raised)."""
    patch_collectives(monkeypatch)
    group = SimulatedGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        group._local.rank = rank
        try:
            results[rank] = work(rank, group)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            errors[rank] = error
            group.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
