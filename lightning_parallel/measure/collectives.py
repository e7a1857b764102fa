"""Counting and timing the collectives DTensor issues (tensor parallelism, loss parallelism, DTensor math).

DTensor reaches the network through ``torch.distributed._functional_collectives``: it calls that module's
``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ... and later ``wait_tensor`` where a result
is first used. :class:`DTensorCollectives` wraps those module functions while it is active, adding up the
bytes each collective is given and the seconds the caller spends issuing and waiting for them (on the
training thread, so this is *exposed* communication). Outside its ``with`` block nothing is wrapped.
FSDP2 and DDP use c10d directly and are not seen here (DDP is counted by its communication hook).
Context parallelism's ring attention and output gathers use the same functions; they are tallied apart,
in :attr:`DTensorCollectives.context_tally`, and so are expert parallelism's token all-to-alls
(:attr:`DTensorCollectives.expert_tally`, with how evenly the router spread the tokens: :class:`ExpertLoad`).
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from lightning_parallel.measure.device_clock import DeviceClock, Elapsed

#: How many context-parallel exchanges (ring attention, sequence gathers) are running on this thread.
_exchanging = [0]


@contextmanager
def context_parallel_exchange() -> Iterator[None]:
    """Marks the collectives issued inside as context parallelism's: :class:`DTensorCollectives` tallies them
    in ``context_tally``, apart from tensor parallelism's (the transforms enter it around their exchanges)."""
    _exchanging[0] += 1
    try:
        yield
    finally:
        _exchanging[0] -= 1


def context_parallel_exchanging() -> bool:
    """Whether a context-parallel exchange is running (see :func:`context_parallel_exchange`)."""
    return _exchanging[0] > 0


#: How many expert-parallel exchanges (token dispatch and combine) are running on this thread.
_dispatching = [0]


@contextmanager
def expert_parallel_exchange() -> Iterator[None]:
    """Marks the collectives issued inside as expert parallelism's (tallied in ``expert_tally``)."""
    _dispatching[0] += 1
    try:
        yield
    finally:
        _dispatching[0] -= 1


class ExpertLoad:
    """How evenly routers spread tokens over experts: per MoE layer call, the busiest expert's tokens over the
    mean (1.0: perfectly even; counted over this rank's tokens), while a :class:`DTensorCollectives` is active.

    Each call's figures are added up on the tokens' device: reading them on the host every MoE layer would stall a
    GPU's stream twice per layer. They are read (one sync) where the monitor takes its snapshot of a step."""

    def __init__(self) -> None:
        self._totals: torch.Tensor | None = None  # [calls, sum of ratios, largest ratio], float64 on the device

    def record(self, tokens_per_expert: torch.Tensor) -> None:
        counts = tokens_per_expert.detach().double()
        mean = counts.mean()
        routed = mean > 0
        ratio = torch.where(routed, counts.max() / mean.clamp_min(1e-300), torch.zeros_like(mean))
        call = torch.stack([routed.double(), ratio, ratio])
        if self._totals is None or self._totals.device != call.device:
            self._totals = torch.zeros(3, dtype=torch.float64, device=call.device)
        self._totals = torch.stack([self._totals[0] + call[0], self._totals[1] + call[1], torch.maximum(self._totals[2], call[2])])

    def read(self) -> tuple[int, float, float]:
        """(calls, sum of the calls' ratios, the largest ratio), in one read of the device."""
        calls, total, largest = [0.0, 0.0, 0.0] if self._totals is None else self._totals.tolist()
        return int(calls), total, largest

    @property
    def calls(self) -> int:
        return self.read()[0]

    @property
    def imbalance_sum(self) -> float:
        return self.read()[1]

    @property
    def imbalance_max(self) -> float:
        return self.read()[2]

    def reset(self) -> None:
        self._totals = None


def record_expert_load(tokens_per_expert: torch.Tensor) -> None:
    """Count one MoE layer's routing (a no-op unless a :class:`DTensorCollectives` is counting)."""
    owner = DTensorCollectives._owner
    if owner is not None and not owner._paused and not _checking[0]:
        owner.expert_load.record(tokens_per_expert)


@dataclass
class ContextWork:
    """Ring attention's work on this rank while a :class:`DTensorCollectives` is active: attention scores computed
    (those of the blocks a mask keeps any of; a causal diagonal block counts half) and skipped (blocks the mask drops
    whole), summed over batch rows and heads; and the busiest context-parallel rank's expected work over the mean for
    the chunk layouts used (packed documents, :mod:`lightning_parallel.parallelize.context.balance`)."""

    scores_computed: float = 0.0
    scores_skipped: float = 0.0
    layouts: int = 0
    imbalance_sum: float = 0.0

    def record(self, computed: float, skipped: float) -> None:
        self.scores_computed += computed
        self.scores_skipped += skipped

    def record_layout(self, rank_work: list[float]) -> None:
        mean = sum(rank_work) / len(rank_work)
        if mean > 0:
            self.layouts += 1
            self.imbalance_sum += max(rank_work) / mean

    def reset(self) -> None:
        self.scores_computed = self.scores_skipped = self.imbalance_sum = 0.0
        self.layouts = 0


def record_context_work(computed: float, skipped: float) -> None:
    """Count one ring attention call's scores (a no-op unless a :class:`DTensorCollectives` is counting)."""
    owner = DTensorCollectives._owner
    if owner is not None and not owner._paused and not _checking[0]:
        owner.context_work.record(computed, skipped)


def record_context_layout(rank_work: list[float]) -> None:
    """Count one model call's chunk layout by every context-parallel rank's expected work (a no-op unless counting)."""
    owner = DTensorCollectives._owner
    if owner is not None and not owner._paused and not _checking[0]:
        owner.context_work.record_layout(rank_work)


#: How many checks outside training (see :func:`outside_training`) are running on this thread.
_checking = [0]


@contextmanager
def outside_training() -> Iterator[None]:
    """Collectives issued inside belong to a one-off check, not to training: :class:`DTensorCollectives` leaves
    them out (the transforms' self-checks enter it)."""
    _checking[0] += 1
    try:
        yield
    finally:
        _checking[0] -= 1


#: The functional collectives DTensor uses; the first argument is the tensor sent.
_COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "all_gather_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)


@dataclass
class CollectiveTally:
    """Totals since the last :meth:`reset`: collectives issued, bytes handed to them, and the time the training
    stream spent issuing and waiting for them (device time on a GPU, see :mod:`.device_clock`)."""

    calls: int = 0
    bytes: int = 0
    elapsed: Elapsed = field(default_factory=Elapsed, repr=False, compare=False)

    @property
    def seconds(self) -> float:
        return self.elapsed.total

    def reset(self) -> None:
        self.calls, self.bytes = 0, 0
        self.elapsed.reset()

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "bytes": self.bytes, "seconds": self.seconds}


class DTensorCollectives:
    """While active (``with counter.active(): ...``), tallies DTensor's functional collectives in :attr:`tally`.

    Nested or concurrent activations are refused: the wrapped functions are process-wide.
    """

    _owner: DTensorCollectives | None = None

    def __init__(self) -> None:
        self.tally = CollectiveTally()
        self.context_tally = CollectiveTally()  # ring attention and sequence gathers (context parallelism)
        self.expert_tally = CollectiveTally()  # token dispatch and combine (expert parallelism)
        self.expert_load = ExpertLoad()
        self.context_work = ContextWork()
        #: Where the time spent in collectives is read (the monitor sets the training device's clock).
        self.clock = DeviceClock("cpu")
        self._paused = False
        # funcol's functions call one another (all_gather_tensor -> all_gather_single -> wait_tensor when the
        # gather dimension is not 0): only the outermost call is counted, or its seconds (and bytes) count twice
        # and the exposed communication can exceed the step it was measured in.
        self._depth = 0

    def _current(self) -> CollectiveTally:
        if _dispatching[0]:
            return self.expert_tally
        return self.context_tally if context_parallel_exchanging() else self.tally

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave out collectives issued inside (e.g. gathering DTensors for a metric or a debug check)."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    @contextmanager
    def active(self) -> Iterator[CollectiveTally]:
        if DTensorCollectives._owner is not None:
            raise RuntimeError("Another DTensorCollectives is already counting in this process; use one at a time.")
        originals = {name: getattr(funcol, name) for name in (*_COLLECTIVES, "wait_tensor") if hasattr(funcol, name)}
        DTensorCollectives._owner = self
        try:
            for name, original in originals.items():
                wrapper = self._timed_wait(original) if name == "wait_tensor" else self._counted(original)
                setattr(funcol, name, wrapper)
            yield self.tally
        finally:
            for name, original in originals.items():
                setattr(funcol, name, original)
            DTensorCollectives._owner = None

    def _counted(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._paused or _checking[0] or self._depth:
                return collective(tensor, *args, **kwargs)
            tally = self._current()
            with self._outermost(tally):
                result = collective(tensor, *args, **kwargs)
            tally.calls += 1
            tally.bytes += tensor.numel() * tensor.element_size()
            return result

        return counted

    def _timed_wait(self, wait: Callable[..., Any]) -> Callable[..., Any]:
        def timed(tensor: torch.Tensor) -> Any:
            if self._paused or _checking[0] or self._depth:
                return wait(tensor)
            with self._outermost(self._current()):
                return wait(tensor)

        return timed

    @contextmanager
    def _outermost(self, tally: CollectiveTally) -> Iterator[None]:
        """Times the block into ``tally``; the funcol calls made inside it are not counted again."""
        self._depth += 1
        start = self.clock.mark()
        try:
            yield
        finally:
            tally.elapsed.add(start, self.clock.mark())
            self._depth -= 1
