"""Timing device work where it runs: CUDA events on a GPU, the host clock on a CPU.

A CUDA kernel or NCCL collective returns to Python as soon as it is queued, so the host clock around it measures
the launch, not the work: exposed communication would read about zero and a pipeline's bubble would absorb
everything. A :class:`DeviceClock` marks points on the current stream instead (``torch.cuda.Event``, recorded
without waiting), and an :class:`Elapsed` adds up intervals between marks, reading the events only when asked for
its total: one synchronize at a measuring window's edge, none inside the step. On the host, where work is done when
its call returns, marks are ``time.perf_counter()`` readings and totals are exact at once.
"""

from __future__ import annotations

import time
from typing import Union

import torch

#: A point on the device's timeline: a recorded CUDA event, or host seconds.
Mark = Union["torch.cuda.Event", float]


class DeviceClock:
    """Marks on the timeline of ``device``'s work (the current stream on CUDA).

    Args:
        device: The device whose work is timed; ``None`` picks this process's current CUDA device when CUDA is in
            use, else the host.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"

    def mark(self) -> Mark:
        """A point in the device's work as queued so far (recording an event does not wait for it)."""
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def seconds(start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end``; for events, waits until ``end`` has happened on the device."""
        if isinstance(start, float):
            return end - start  # type: ignore[operator]
        end.synchronize()  # type: ignore[union-attr]
        return start.elapsed_time(end) / 1000.0  # type: ignore[union-attr]


class Elapsed:
    """A running total of intervals between marks, resolved when read (at most one synchronize per read)."""

    def __init__(self) -> None:
        self._resolved = 0.0
        self._pending: list[tuple[Mark, Mark]] = []

    def add(self, start: Mark, end: Mark) -> None:
        """Count the interval from ``start`` to ``end`` (host marks now, event pairs when read)."""
        if isinstance(start, float):
            self._resolved += end - start  # type: ignore[operator]
        else:
            self._pending.append((start, end))

    def add_seconds(self, seconds: float) -> None:
        """Count a duration measured elsewhere."""
        self._resolved += seconds

    @property
    def total(self) -> float:
        """Seconds counted since the last :meth:`reset` (reads pending events: a window's edge)."""
        if self._pending:
            self._resolved += sum(DeviceClock.seconds(start, end) for start, end in self._pending)
            self._pending.clear()
        return self._resolved

    def reset(self) -> None:
        self._resolved = 0.0
        self._pending.clear()
