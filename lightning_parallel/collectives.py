"""Every collective and point-to-point call the library makes, each on the device its group's backend serves.

NCCL takes CUDA tensors only; gloo takes host tensors (and CUDA ones, by copying). A module built the usual way
(on the host) is still there while the strategy sets up, so a direct ``torch.distributed`` call with one of its
tensors works on gloo and fails on NCCL (``No backend type associated with device type cpu``). The functions here
take the group and, when a tensor sits on a device the group's backend does not serve, run the collective on a
copy on the group's device (this process's current CUDA device) and write the result back: a no-op on gloo and
for tensors already placed, one copy each way otherwise (setup only: the training step hands device tensors).

``tests/unit/test_collectives_module.py`` fails on a direct ``torch.distributed`` collective anywhere else in the
package, so the rule holds by construction rather than by review.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = [
    "group_device",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_coalesced",
    "sync_module_states",
    "send",
    "recv",
    "barrier",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "differentiable_all_reduce",
    "functional_all_gather",
    "functional_all_gather_autograd",
    "functional_all_reduce",
    "functional_reduce_scatter",
    "functional_all_to_all_single",
]

SUM = dist.ReduceOp.SUM
MAX = dist.ReduceOp.MAX
MIN = dist.ReduceOp.MIN


def _device_types(group: dist.ProcessGroup | None) -> list[torch.device]:
    group = group if group is not None else dist.group.WORLD
    # ProcessGroup._device_types is private (checked against torch 2.13): the device types a group has a backend
    # for; "gloo" registers cpu and cuda, "nccl" and "cuda:gloo" cuda only, "fake" both.
    types = getattr(group, "_device_types", None)
    return list(types) if types else [torch.device("cpu")]


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device tensors must sit on for a collective over ``group``: the host when its backend serves it (gloo),
    else this process's current device of the backend's type (NCCL: the rank's CUDA device)."""
    types = [device.type for device in _device_types(group)]
    if "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    module = getattr(torch, kind, None)
    available = module is not None and hasattr(module, "is_available") and module.is_available()
    # Without the device itself (a fake backend's dry run on a host), the type alone: fake tensors carry no index.
    return torch.device(kind, module.current_device()) if available else torch.device(kind)


def _served(tensor: Tensor, group: dist.ProcessGroup | None) -> bool:
    return tensor.device.type in {device.type for device in _device_types(group)}


@contextmanager
def _placed(tensors: Sequence[Tensor], group: dist.ProcessGroup | None, written: Sequence[bool]) -> Iterator[list[Tensor]]:
    """The tensors as the group's backend takes them; those marked ``written`` are copied back afterwards."""
    if all(_served(t, group) for t in tensors):
        yield list(tensors)
        return
    device = group_device(group)
    placed = [t if _served(t, group) else _copy_to(t, device) for t in tensors]
    yield placed
    for original, copy, write in zip(tensors, placed, written):
        if write and copy is not original:
            _copy_back(original, copy)


def _copy_to(tensor: Tensor, device: torch.device) -> Tensor:
    return tensor.to(device)


def _copy_back(original: Tensor, copy: Tensor) -> None:
    original.copy_(copy)


def all_reduce(tensor: Tensor, op: dist.ReduceOp = SUM, group: dist.ProcessGroup | None = None) -> Tensor:
    """Reduce ``tensor`` in place over ``group`` (default: the world); returns it."""
    with _placed([tensor], group, [True]) as (placed,):
        dist.all_reduce(placed, op=op, group=group)
    return tensor


def all_gather(tensor: Tensor, group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in group-rank order, on ``tensor``'s device."""
    with _placed([tensor], group, [False]) as (placed,):
        gathered = [torch.empty_like(placed) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, placed, group=group)
    return [g.to(tensor.device) for g in gathered]


def all_gather_into_tensor(output: Tensor, tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 into ``output`` (written in place); returns ``output``."""
    with _placed([output, tensor], group, [True, False]) as (placed_output, placed):
        dist.all_gather_into_tensor(placed_output, placed, group=group)
    return output


def all_to_all_single(
    output: Tensor,
    tensor: Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """``torch.distributed.all_to_all_single`` on the group's device; ``output`` is written in place and returned."""
    with _placed([output, tensor], group, [True, False]) as (placed_output, placed):
        dist.all_to_all_single(placed_output, placed, output_split_sizes, input_split_sizes, group=group)
    return output


def reduce_scatter_tensor(
    output: Tensor, tensor: Tensor, op: dist.ReduceOp = SUM, group: dist.ProcessGroup | None = None
) -> Tensor:
    """``tensor`` reduced over ``group``, this rank's slice (along dim 0) written into ``output``; returns ``output``."""
    with _placed([output, tensor], group, [True, False]) as (placed_output, placed):
        dist.reduce_scatter_tensor(placed_output, placed, op=op, group=group)
    return output


def broadcast(tensor: Tensor, group: dist.ProcessGroup | None = None, group_src: int = 0) -> Tensor:
    """Rank ``group_src`` of ``group``'s ``tensor`` written into every rank's ``tensor``; returns it."""
    with _placed([tensor], group, [True]) as (placed,):
        dist.broadcast(placed, group=group, group_src=group_src)
    return tensor


def broadcast_coalesced(
    tensors: Sequence[Tensor], group: dist.ProcessGroup | None = None, group_src: int = 0, bucket_bytes: int = 256 << 20
) -> None:
    """Rank ``group_src``'s values written into every rank's ``tensors`` (plain tensors, not DTensors), a few
    flat buckets per dtype rather than one collective per tensor: the way replicas start from the same weights."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
    for same_dtype in by_dtype.values():
        for bucket in _buckets(same_dtype, bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1).to(bucket[0].device) for t in bucket])
            broadcast(flat, group, group_src)  # on the group's device: one copy each way for a host bucket
            offset = 0
            for held in bucket:
                held.copy_(flat[offset : offset + held.numel()].view_as(held))
                offset += held.numel()


def _buckets(tensors: list[Tensor], limit: int) -> Iterator[list[Tensor]]:
    bucket: list[Tensor] = []
    size = 0
    for tensor in tensors:
        if bucket and size + tensor.nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.nbytes
    if bucket:
        yield bucket


def sync_module_states(
    module: torch.nn.Module, group: dist.ProcessGroup | None = None, keep: Sequence[Tensor] = ()
) -> None:
    """Every rank's parameters and buffers of ``module`` set to the group's first rank's, wherever they are held
    (on the host too, which NCCL alone would refuse). Meta tensors hold nothing to send; DTensors are skipped: their
    local parts differ per rank by design, and were made from synced weights when the module was split; so are the
    tensors in ``keep`` (this rank's own experts under expert parallelism, which other ranks do not hold)."""
    seen: set[int] = {id(t) for t in keep}
    tensors = []
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen and tensor.device.type != "meta" and not isinstance(tensor, DTensor):
            seen.add(id(tensor))
            tensors.append(tensor)
    with torch.no_grad():
        broadcast_coalesced(tensors, group)


def send(tensor: Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    with _placed([tensor], group, [False]) as (placed,):
        dist.send(placed, dst, group=group)


def recv(tensor: Tensor, src: int, group: dist.ProcessGroup | None = None) -> Tensor:
    """Receive into ``tensor`` from global rank ``src`` (blocking); returns it."""
    with _placed([tensor], group, [True]) as (placed,):
        dist.recv(placed, src, group=group)
    return tensor


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group``; on NCCL on this rank's device (no guess from the global rank)."""
    device = group_device(group)
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order (torch stages the bytes on the group's device)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_object(obj: Any, group: dist.ProcessGroup | None = None, dst_group_rank: int = 0) -> list[Any] | None:
    """Every rank's picklable ``obj`` on rank ``dst_group_rank`` of ``group`` (in group-rank order); ``None`` elsewhere."""
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst_group_rank else None
    dist.gather_object(obj, gathered, group_dst=dst_group_rank, group=group)
    return gathered


def broadcast_object_list(objects: list[Any], src: int = 0, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Global rank ``src``'s picklable objects written into ``objects`` on every rank of ``group``; returns it."""
    dist.broadcast_object_list(objects, src=src, group=group)
    return objects


# Functional (traceable, autograd-aware where named so) collectives, for tensors already on the rank's device: the
# activations of a training step. torch.distributed._functional_collectives is private (checked against
# torch 2.13): it is what DTensor itself uses, and the only traceable form.


def _functional() -> Any:
    from torch.distributed import _functional_collectives

    return _functional_collectives


def functional_all_gather(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` (waited on; not differentiable)."""
    funcol = _functional()
    return funcol.wait_tensor(funcol.all_gather_single(tensor.contiguous(), dim, group))


def functional_all_gather_autograd(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """As :func:`functional_all_gather`, differentiable (the backward reduce-scatters the gradient)."""
    funcol = _functional()
    return funcol.wait_tensor(funcol.all_gather_tensor_autograd(tensor.contiguous(), dim, group))


def differentiable_all_reduce(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """The sum of ``tensor`` over ``group`` as a new tensor whose backward sums the gradient over ``group`` too."""
    from torch.distributed.nn import functional as autograd_collectives

    return autograd_collectives.all_reduce(tensor, op=SUM, group=group)


def functional_all_reduce(tensor: Tensor, op: str, group: dist.ProcessGroup) -> Tensor:
    """A new tensor: ``tensor`` reduced with ``op`` (``"sum"``, ``"min"``, ``"max"``, ``"avg"``) over ``group``."""
    funcol = _functional()
    return funcol.wait_tensor(funcol.all_reduce(tensor, op, group))


def functional_reduce_scatter(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's equal chunk along ``dim`` of ``tensor`` summed over ``group`` (waited on; not differentiable)."""
    funcol = _functional()
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(tensor.contiguous(), "sum", dim, group))


def functional_all_to_all_single(
    tensor: Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None, group: dist.ProcessGroup
) -> Tensor:
    """``all_to_all_single`` for use inside an ``autograd.Function`` (waited on; not differentiable itself)."""
    funcol = _functional()
    return funcol.wait_tensor(funcol.all_to_all_single(tensor, output_split_sizes, input_split_sizes, group))
