"""What the last pipeline stage shares with every stage after a step: what the user's step returned and logged.

Only the last stage runs the user's step (it holds the model's output), but every rank needs its results:
Lightning's loop takes the loss, and progress bars, ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` read the
logged values on every rank. Pickled each step, they would cost a device-to-host copy per tensor on the last stage
and, on every other rank, a collective for the size, a host read of it, and a second collective. Instead the
*structure* (containers, names, options, and each tensor's dtype and shape) is sent once as an object and kept on
every rank; each step then sends one flat byte tensor on the group's device, whose first byte says whether the
structure changed (it is then sent again, and the tensors after it). A step costs one broadcast, plus one host
read of that byte on the ranks that receive, whatever the number of micro-batches or logged values.
"""

from __future__ import annotations

import enum
import math
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_parallel import collectives
from lightning_parallel.strategies.collectives import whole

#: Every tensor starts at a multiple of this many bytes of the buffer (read back as views of it); the first
#: bytes hold the "structure changed" flag.
ALIGN = 16

#: Leaves other than tensors that may be kept in a cached structure (compared with ``==`` each step).
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum,
              types.FunctionType, types.BuiltinFunctionType)


@dataclass(frozen=True)
class _Slot:
    """Where one tensor sits in the buffer."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ResultLayout:
    """The structure of a step's results: containers and constants as they are, tensors as slots in one buffer.

    ``cacheable`` is false when a leaf is neither a tensor nor a plain constant (an object that may hold
    tensors, or whose equality is not a plain value's): such results travel whole, as objects, every step.
    """

    spec: TreeSpec
    leaves: tuple[Any, ...]
    nbytes: int
    cacheable: bool

    @classmethod
    def of(cls, value: Any) -> tuple[ResultLayout, list[Tensor]]:
        """The layout of ``value`` and its tensors in slot order (host work only: no tensor is read)."""
        flat, spec = tree_flatten(value)
        leaves: list[Any] = []
        tensors: list[Tensor] = []
        offset, cacheable = ALIGN, True
        for leaf in flat:
            if isinstance(leaf, Tensor):
                tensor = whole(leaf).detach()
                slot = _Slot(tensor.dtype, tuple(tensor.shape), offset)
                offset += -(-slot.nbytes // ALIGN) * ALIGN
                leaves.append(slot)
                tensors.append(tensor)
            else:
                cacheable = cacheable and isinstance(leaf, _CONSTANTS)
                leaves.append(leaf)
        return cls(spec, tuple(leaves), offset, cacheable), tensors

    def matches(self, other: ResultLayout) -> bool:
        return (
            self.cacheable and other.cacheable and self.spec == other.spec and len(self.leaves) == len(other.leaves)
            and all(_same(a, b) for a, b in zip(self.leaves, other.leaves))
        )

    def pack(self, tensors: list[Tensor], device: torch.device) -> Tensor:
        """One byte buffer holding ``tensors`` at their slots (flag byte 0: the structure is this one)."""
        buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        for slot, tensor in zip(self._slots(), tensors):
            flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
            buffer[slot.offset : slot.offset + slot.nbytes].copy_(flat.view(torch.uint8))
        return buffer

    def changed(self, device: torch.device) -> Tensor:
        """A buffer of this layout's size whose flag byte says: the structure changed, it follows as an object."""
        buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        buffer[0] = 1
        return buffer

    def empty(self, device: torch.device) -> Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def unpack(self, buffer: Tensor) -> Any:
        """The results, tensors as views of ``buffer`` (no copy, nothing read on the host)."""
        leaves = [
            buffer[leaf.offset : leaf.offset + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape) if isinstance(leaf, _Slot) else leaf
            for leaf in self.leaves
        ]
        return tree_unflatten(leaves, self.spec)

    def _slots(self) -> list[_Slot]:
        return [leaf for leaf in self.leaves if isinstance(leaf, _Slot)]


class LastStageResults:
    """Shares the last stage's step results with every rank of a pipeline group, a structure kept per hook.

    Args:
        group: The pipeline group.
        src: The group rank holding the last stage.
        src_global: Its global rank.
        is_src: Whether this rank holds the last stage.
        device: Where the buffer is made (this rank's device; :mod:`lightning_parallel.collectives` moves it
            where the group's backend wants it).
    """

    def __init__(self, group: dist.ProcessGroup, src: int, src_global: int, is_src: bool, device: torch.device) -> None:
        self.group, self.src, self.src_global, self.is_src, self.device = group, src, src_global, is_src, device
        #: The structure every rank of the group holds for each hook (kept in step on every rank).
        self._layouts: dict[str, ResultLayout] = {}

    def share(self, hook: str, results: Any) -> Any:
        """``results`` (given on the last stage, ``None`` elsewhere) on every rank of the group.

        The last stage gets its own ``results`` back; the other ranks get tensors on ``device`` (detached).
        """
        layout, tensors = ResultLayout.of(results) if self.is_src else (None, [])
        kept = self._layouts.get(hook)
        if kept is not None:
            if self.is_src:
                same = layout.matches(kept)
                collectives.broadcast(kept.pack(tensors, self.device) if same else kept.changed(self.device), self.group, self.src)
                if same:
                    return results
            else:
                buffer = collectives.broadcast(kept.empty(self.device), self.group, self.src)
                if not bool(buffer[0]):  # the one host read of a step
                    return kept.unpack(buffer)
        # First time for this hook, or its structure changed: the structure as an object (with the results
        # themselves where they cannot be cached), then the tensors.
        message = [(layout, None if layout.cacheable else _to_cpu(results)) if self.is_src else None]
        layout, whole_results = collectives.broadcast_object_list(message, src=self.src_global, group=self.group)[0]
        if not layout.cacheable:
            self._layouts.pop(hook, None)
            return results if self.is_src else _to_device(whole_results, self.device)
        self._layouts[hook] = layout
        buffer = layout.pack(tensors, self.device) if self.is_src else layout.empty(self.device)
        collectives.broadcast(buffer, self.group, self.src)
        return results if self.is_src else layout.unpack(buffer)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _Slot) or isinstance(b, _Slot):
        return a == b
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # an equality that is not a plain value's: not the same
        return False


def _to_cpu(value: Any) -> Any:
    return apply_to_collection(value, Tensor, lambda t: whole(t).detach().cpu())


def _to_device(value: Any, device: torch.device) -> Any:
    return apply_to_collection(value, Tensor, lambda t: t.to(device))
