"""Peak memory one rank held during a run, setup included: what the planner's per-rank memory prediction claims.

On CUDA the allocator's own peak (``torch.cuda.max_memory_allocated``, reset when tracking starts). On a CPU,
where torch keeps no allocator statistics, the process's peak resident memory (Linux ``VmHWM``, reset through
``/proc/self/clear_refs`` when tracking starts) minus the resident memory at that moment, plus the bytes the
module's tensors already held then (a model built eagerly before the strategy set it up is part of what the rank
holds). Resident memory also counts what is not a tensor (the process group's buffers, traced graphs, allocator
slack), so a CPU figure is an upper bound whose overhead matters only for small models. Elsewhere (no ``/proc``):
nothing measured. No Lightning here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import torch
from torch import nn

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _release_free_heap() -> None:
    """Hand memory freed earlier back to the OS (glibc ``malloc_trim``), so that the baseline counts none of it:
    allocations that reuse freed but still resident pages would not raise the resident peak."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: the figure may then read low by what was free
        pass


def held_tensor_bytes(module: nn.Module) -> int:
    """Bytes the module's parameters and buffers hold on this rank now (meta tensors hold none; shared once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_meta or local.untyped_storage().data_ptr() in seen:
            continue
        seen.add(local.untyped_storage().data_ptr())
        total += local.untyped_storage().nbytes()
    return total


class PeakMemory:
    """Track this rank's peak memory from :meth:`start` on; :meth:`peak_bytes` reads it (``None``: not measurable)."""

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._baseline = 0
        self._held = 0

    def start(self, module: nn.Module, device: torch.device) -> None:
        """Reset the peak now; ``module``'s tensors held at this moment count as held by the run."""
        self._device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        self._held = held_tensor_bytes(module)
        _release_free_heap()
        try:
            _CLEAR_REFS.write_text("5")  # VmHWM := VmRSS: the peak from here on
        except OSError:
            self._device = None  # no /proc (not Linux): nothing measured
            return
        self._baseline = _status_bytes("VmRSS") or 0

    def peak_bytes(self) -> int | None:
        """The most this rank held since :meth:`start`, in bytes."""
        if self._device is None:
            return None
        if self._device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self._device))
        peak = _status_bytes("VmHWM")
        return None if peak is None else peak - self._baseline + self._held
