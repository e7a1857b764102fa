"""Starting values drawn straight into each rank's shards, on its device (``init_values="draw_into_shards"``).

Eager-equal initialisation (:class:`~lightning_parallel.parallelize.placement.deferred_init.InitialValues`) gives
every parameter the bits building on one host would: it materialises each module whole on the host and draws its
random numbers there, on one CPU thread's generator — for a 70B-parameter model hours, and the largest module whole
on every rank. Drawing into shards keeps the distribution and drops the bits: the module's own initialisation
(``reset_parameters()``, ``_init_weights``) runs on the meta skeleton, where it costs nothing, and a dispatch mode
records what it does to each parameter — ``uniform_(-b, b)``, ``normal_(0, 0.02)``, ``fill_(1)``,
``nn.init.trunc_normal_``, scalar arithmetic after them, a padding row's ``zero_()``. Each rank then replays those steps
on the part it holds (a DTensor's local shard, a pipeline stage's tensor), on its device, with a generator of that
device seeded by (a seed rank 0 draws, the parameter's name, the part's global offset): parts that replicas hold alike
get the same values, different parts independent ones. The scales come from the whole shape (the skeleton's), so a
shard's values have the distribution the whole tensor's would.

Only steps that act on each element alone can be replayed on a part: anything else (``copy_`` from another tensor,
``orthogonal_``, a parameter made by ``torch.randn(...) * s`` in ``__init__`` with no reset) is refused, naming the
parameter and the operator, with the fix (``init_values="eager"``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: In-place random draws: each element drawn alone (a part draws its own elements the same way).
DRAWS = {aten.uniform_.default, aten.normal_.default, aten.exponential_.default, aten.log_normal_.default,
         aten.cauchy_.default, aten.geometric_.default, aten.bernoulli_.float, aten.random_.default, aten.random_.to,
         getattr(aten.random_, "from")}
#: In-place operators with scalar arguments that act on each element alone.
ELEMENTWISE = {aten.fill_.Scalar, aten.zero_.default, aten.mul_.Scalar, aten.add_.Scalar, aten.sub_.Scalar,
               aten.div_.Scalar, aten.clamp_.default, aten.clamp_min_.default, aten.clamp_max_.default,
               aten.erfinv_.default, aten.abs_.default, aten.neg_.default, aten.sqrt_.default, aten.exp_.default,
               aten.log_.default, aten.pow_.Scalar, aten.tanh_.default}
#: Operators that write a value independent of what was there (the steps before them no longer matter).
OVERWRITES = DRAWS | {aten.fill_.Scalar, aten.zero_.default}
#: Operators that read a tensor without changing it (allowed on a recorded parameter, not recorded).
_READS = {aten.detach.default, aten.alias.default, aten.view.default, aten.select.int, aten.slice.Tensor,
          aten.t.default, aten.transpose.int, aten.as_strided.default, aten._to_copy.default, aten.clone.default,
          aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default, aten._unsafe_view.default}


@dataclass(frozen=True)
class Step:
    """One recorded operation on a parameter: ``op(region, *args, **kwargs)``; ``view`` is ``None`` for the whole
    parameter, else the region's (sizes, strides, storage offset) in the whole contiguous parameter."""

    op: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None
    draws: bool  # takes a generator


@dataclass
class Recorded:
    """What the initialisation did to one parameter: its steps, or why it cannot be replayed on a part."""

    steps: list[Step]
    refused: str | None = None


class StepRecorder(TorchDispatchMode):
    """Records, per parameter of a meta skeleton, the in-place operations its initialisation runs on it.

    Args:
        parameters: The skeleton's parameters (meta), by first full name.
    """

    def __init__(self, parameters: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.names = {StorageWeakRef(p.untyped_storage()): name for name, p in parameters.items()}
        self.shapes = {name: tuple(p.shape) for name, p in parameters.items()}
        self.recorded: dict[str, Recorded] = {name: Recorded([]) for name in parameters}

    def refuse(self, name: str, why: str) -> None:
        """Mark ``name`` as not replayable on a part (until an operation overwrites it whole)."""
        self.recorded[name] = Recorded([], why)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], Tensor) else None
        name = self._name_of(target)
        if name is not None and func not in _READS and func._schema.is_mutable:
            self._record(name, target, func, args[1:], kwargs)  # type: ignore[arg-type]
        elif func._schema.is_mutable:
            # A parameter written through another argument (``torch.where(..., out=p)``, ``other.copy_(p)`` reads it).
            for value in [*args[1:], *kwargs.values()]:
                written = self._name_of(value) if isinstance(value, Tensor) else None
                if written is not None and func._schema.arguments and any(
                    a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments[1:]
                ):
                    self.refuse(written, f"written by {func}")
        return func(*args, **kwargs)

    def _name_of(self, tensor: Tensor | None) -> str | None:
        if tensor is None or not tensor.is_meta:
            return None
        return self.names.get(StorageWeakRef(tensor.untyped_storage()))

    def _record(self, name: str, target: Tensor, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        whole = tuple(target.shape) == self.shapes[name] and target.storage_offset() == 0 and target.is_contiguous()
        view = None if whole else (tuple(target.shape), tuple(target.stride()), target.storage_offset())
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, Tensor)]
        if func not in DRAWS and func not in ELEMENTWISE or tensors:
            self.refuse(name, f"{func} with {'a tensor argument' if tensors else 'no elementwise replay'}")
            return
        if view is not None and func not in (aten.fill_.Scalar, aten.zero_.default):
            self.refuse(name, f"{func} on a part of it (only fill_/zero_ of a part are replayed)")
            return
        step = Step(func, tuple(args), dict(kwargs), view, func in DRAWS)
        if whole and func in OVERWRITES:
            self.recorded[name] = Recorded([step])
        elif self.recorded[name].refused is None:
            self.recorded[name].steps.append(step)

    @contextmanager
    def recording(self) -> Iterator[StepRecorder]:
        """Record inside; ``nn.init.trunc_normal_`` (rejection sampling: no elementwise aten steps) as one step."""

        def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                          generator: torch.Generator | None = None) -> Tensor:
            name = self._name_of(tensor)
            if name is not None:
                whole = tuple(tensor.shape) == self.shapes[name] and tensor.storage_offset() == 0
                if whole:
                    self.recorded[name] = Recorded([Step(_trunc_normal, (mean, std, a, b), {}, None, True)])
                else:
                    self.refuse(name, "nn.init.trunc_normal_ on a part of it")
            return tensor

        with mock.patch.object(nn.init, "trunc_normal_", trunc_normal_), torch.no_grad(), self:
            yield self


def _trunc_normal(tensor: Tensor, mean: float, std: float, a: float, b: float, generator: torch.Generator | None = None) -> Tensor:
    return torch.nn.init._no_grad_trunc_normal_(tensor, mean, std, a, b, generator=generator)


def part_of(target: Tensor, whole_shape: tuple[int, ...]) -> tuple[Tensor, tuple[int, ...]]:
    """The tensor this rank writes for ``target`` and where it starts in the whole parameter (its global offset)."""
    if isinstance(target, DTensor):
        # torch 2.13: DTensor's own helper for a local shard's place (private; no public equivalent).
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return target.to_local(), tuple(int(o) for o in offset)
    if tuple(target.shape) != tuple(whole_shape):
        raise RuntimeError(f"A plain tensor of shape {tuple(target.shape)} stands for a parameter of shape "
                           f"{tuple(whole_shape)}: it is neither whole nor a DTensor shard.")
    return target, (0,) * target.dim()


def part_seed(seed: int, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """A generator seed for one part of one parameter: equal for equal parts (replicas), unrelated otherwise."""
    digest = hashlib.blake2b(f"{seed}:{name}:{offset}:{shape}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@torch.no_grad()
def draw_into(local: Tensor, offset: tuple[int, ...], whole_shape: tuple[int, ...], steps: list[Step], seed: int) -> None:
    """Replay ``steps`` on ``local``, the part of a ``whole_shape`` parameter that starts at ``offset``."""
    generator = torch.Generator(device=local.device).manual_seed(seed)
    for step in steps:
        if step.view is None:
            kwargs = {**step.kwargs, "generator": generator} if step.draws else dict(step.kwargs)
            step.op(local, *step.args, **kwargs)
            continue
        index = _view_index(step.view, whole_shape, offset, tuple(local.shape), local.device)
        if index is not None:
            value = 0.0 if step.op is aten.zero_.default else step.args[0]
            local[index] = value


def _view_index(
    view: tuple[tuple[int, ...], tuple[int, ...], int], whole_shape: tuple[int, ...], offset: tuple[int, ...],
    local_shape: tuple[int, ...], device: torch.device,
) -> tuple[Tensor, ...] | None:
    """The local coordinates of the elements of ``view`` (of the whole contiguous parameter) that this part holds."""
    sizes, strides, start = view
    linear = torch.full((), start, dtype=torch.int64, device=device)
    for dim, (size, stride) in enumerate(zip(sizes, strides)):
        shape = [1] * len(sizes)
        shape[dim] = size
        linear = linear + (torch.arange(size, device=device) * stride).view(shape)
    linear = linear.reshape(-1)
    coordinates, rest = [], linear
    for size in reversed(whole_shape):
        coordinates.append(rest % size)
        rest = rest // size
    coordinates.reverse()
    held = torch.ones_like(linear, dtype=torch.bool)
    for coordinate, first, size in zip(coordinates, offset, local_shape):
        held &= (coordinate >= first) & (coordinate < first + size)
    if not bool(held.any()):
        return None
    return tuple((coordinate[held] - first) for coordinate, first in zip(coordinates, offset))

