"""Peak memory one rank held during a run, setup included: what the planner's per-rank memory prediction claims.

On CUDA the allocator's own peak (``torch.cuda.max_memory_allocated``, reset when tracking starts): the bytes handed
out to tensors, not what the caching allocator kept besides. On a CPU (glibc), the same figure from the C allocator
that CPU tensors are allocated from (:func:`allocated_bytes`, ``mallinfo2``: blocks in use, its free blocks
left out), sampled every 50 ms by a thread of its own, less that figure when tracking started, plus the bytes the
module's tensors already held then (a model built eagerly before the strategy set it up is part of what the rank
holds). The sampling thread touches no module and no hook, so it changes nothing that compiles or traces. A step's
peak comes back every step at another phase of the samples, so a run of many steps finds it; a run of a few short
steps may read low.

Why not the resident peak: glibc keeps freed blocks under its mmap threshold (which grows to 32 MiB as large blocks
are freed) resident for reuse, and a training step frees and allocates the same sizes in another order each time, so
a small model's resident peak settles at up to twice what its tensors ever held at once (the recipe GPT: 143 MiB
resident for 87 MiB in use). That figure (:meth:`PeakMemory.resident_peak_bytes`, Linux ``VmHWM``) is what the OS
sees and stays reported beside it; it is the one measured where glibc's statistics are not there. Elsewhere (no
``/proc``): nothing measured. No Lightning here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from pathlib import Path

import torch
from torch import nn

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
#: Seconds between two samples of a CPU process's allocated bytes: a training step's peak recurs every step at another
#: phase of the samples, so over a run they find them; sampling more often costs step time (1 ms: +15 % on 2 cores).
SAMPLE_PERIOD_S = 0.05


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


@functools.cache
def _mallinfo2() -> object | None:
    function = getattr(_libc(), "mallinfo2", None)
    if function is None:  # not glibc, or older than 2.33
        return None
    function.restype = _MallInfo2
    return function


def allocated_bytes() -> int | None:
    """The bytes this process's C allocator has handed out and not taken back (glibc's ``mallinfo2``: blocks in use
    in its heaps plus the blocks it mapped on their own), ``None`` where that is not glibc 2.33 or later. Every CPU
    tensor's storage is such a block; freed blocks the allocator keeps for reuse are not counted."""
    mallinfo = _mallinfo2()
    if mallinfo is None:
        return None
    info = mallinfo()
    return info.uordblks + info.hblkhd


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
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # not glibc: the figure may then read low by what was free
        trim(0)


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


class _Sampler(threading.Thread):
    """Samples :func:`allocated_bytes` every :data:`SAMPLE_PERIOD_S` and keeps the largest."""

    def __init__(self, first: int) -> None:
        super().__init__(name="lightning-parallel-memory-sampler", daemon=True)
        self.peak = first
        self._stop_requested = threading.Event()

    def run(self) -> None:
        while not self._stop_requested.wait(SAMPLE_PERIOD_S):
            self.sample()

    def sample(self) -> None:
        self.peak = max(self.peak, allocated_bytes() or 0)

    def stop(self) -> None:
        self._stop_requested.set()
        self.join()
        self.sample()


class PeakMemory:
    """Track this rank's peak memory from :meth:`start` on; :meth:`peak_bytes` reads it (``None``: not measurable).

    On a CPU a sampling thread runs from :meth:`start` until :meth:`stop`."""

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._baseline = 0
        self._resident_baseline = 0
        self._held = 0
        self._sampler: _Sampler | None = None
        self._peak: int | None = None

    def start(self, module: nn.Module, device: torch.device) -> None:
        """Reset the peak now; ``module``'s tensors held at this moment count as held by the run."""
        self.stop()
        self._device, self._peak = device, None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        self._held = held_tensor_bytes(module)
        _release_free_heap()
        try:
            _CLEAR_REFS.write_text("5")  # VmHWM := VmRSS: the resident peak from here on
        except OSError:
            self._device = None  # no /proc (not Linux): nothing measured
            return
        self._resident_baseline = _status_bytes("VmRSS") or 0
        allocated = allocated_bytes()
        if allocated is not None:  # glibc: sample its figure (otherwise the resident peak stands for it)
            self._baseline = allocated
            self._sampler = _Sampler(allocated)
            self._sampler.start()

    def stop(self) -> None:
        """End the tracking: the peak is fixed from here on (the sampling thread, if any, ends)."""
        if self._sampler is not None:
            self._sampler.stop()
            self._peak = self._sampled_peak()
            self._sampler = None

    def peak_bytes(self) -> int | None:
        """The most this rank held since :meth:`start`, in bytes."""
        if self._device is None:
            return None
        if self._device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self._device))
        if self._sampler is not None:
            self._sampler.sample()
            return self._sampled_peak()
        return self._peak if self._peak is not None else self.resident_peak_bytes()

    def _sampled_peak(self) -> int:
        assert self._sampler is not None
        return self._sampler.peak - self._baseline + self._held

    def resident_peak_bytes(self) -> int | None:
        """On a CPU, the resident peak since :meth:`start` (glibc's cache of freed blocks included), in bytes."""
        if self._device is None or self._device.type == "cuda":
            return None
        peak = _status_bytes("VmHWM")
        return None if peak is None else peak - self._resident_baseline + self._held
