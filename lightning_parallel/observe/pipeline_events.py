"""Recording what each pipeline stage does when: forward, backward and weight-gradient actions per micro-batch.

:class:`PipelineEvents` wraps the training stages' ``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk`` (the calls every torch pipelining schedule makes) and the schedule's
``step``. Each schedule step yields its span and the time spent in actions; the rest of the span the rank
waited for other stages (the bubble, including stage-to-stage transfers). The actions of one chosen step
are kept as events for a timeline picture. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_parallel.measure.device_clock import DeviceClock, Elapsed, Mark

#: Stage methods and the letter a timeline shows for them.
ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


@dataclass(frozen=True)
class StageEvent:
    """One action of one stage, in seconds since its schedule step began."""

    stage: int
    kind: str  # F, B or W
    microbatch: int
    start: float
    end: float


class PipelineEvents:
    """Times a pipeline's schedule steps and stage actions (attach once the pipeline is built).

    Times are the device's (:class:`~lightning_parallel.measure.device_clock.DeviceClock`: CUDA events on a GPU,
    read only when the totals or events are taken, at a measuring window's edge; the host clock on a CPU).

    Attributes:
        span_seconds: Time inside schedule steps since the last :meth:`take_totals`.
        busy_seconds: Of that, time inside stage actions.
        events: The actions of the step being recorded (see :meth:`record_next_step`).
    """

    def __init__(self) -> None:
        self._span = Elapsed()
        self._busy = Elapsed()
        self._marks: list[tuple[int, str, int, Mark, Mark]] = []
        self._recording = False
        self._record_next = False
        self._step_start: Mark = 0.0
        self._recorded_start: Mark = 0.0
        self._clock = DeviceClock("cpu")
        self._attached = False

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def span_seconds(self) -> float:
        return self._span.total

    @property
    def busy_seconds(self) -> float:
        return self._busy.total

    @property
    def events(self) -> list[StageEvent]:
        since = DeviceClock.seconds
        start = self._recorded_start
        return [StageEvent(stage, kind, chunk, since(start, a), since(start, b)) for stage, kind, chunk, a, b in self._marks]

    def attach(self, schedule: Any, stages: list[Any]) -> None:
        """Wrap ``schedule.step`` and each stage's action methods (instance attributes; torch's classes are untouched)."""
        if self._attached:
            return
        self._clock = DeviceClock(getattr(stages[0], "device", "cpu") if stages else "cpu")
        for stage in stages:
            for method, kind in ACTIONS.items():
                if hasattr(stage, method):
                    setattr(stage, method, self._timed_action(getattr(stage, method), stage.stage_index, kind))
        schedule.step = self._timed_step(schedule.step)
        # The loss (the user's step on the last stage) runs between actions: it is work, not waiting.
        if callable(getattr(schedule, "_loss_fn", None)):
            schedule._loss_fn = self._timed_loss(schedule._loss_fn)
        self._attached = True

    def record_next_step(self) -> None:
        """Keep the events of the next schedule step (replacing those kept before)."""
        self._record_next = True

    def take_totals(self) -> tuple[float, float]:
        """(span, busy) seconds since the last call; resets them."""
        totals = (self._span.total, self._busy.total)
        self._span.reset()
        self._busy.reset()
        return totals

    def _timed_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._recording, self._record_next = self._record_next, False
            self._step_start = self._clock.mark()
            if self._recording:
                self._marks, self._recorded_start = [], self._step_start
            try:
                return step(*args, **kwargs)
            finally:
                self._span.add(self._step_start, self._clock.mark())
                self._recording = False

        return timed

    def _timed_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._clock.mark()
            try:
                return loss_fn(*args, **kwargs)
            finally:
                self._busy.add(start, self._clock.mark())

        return timed

    def _timed_action(self, action: Callable[..., Any], stage: int, kind: str) -> Callable[..., Any]:
        def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = self._clock.mark()
            try:
                return action(chunk, *args, **kwargs)
            finally:
                end = self._clock.mark()
                self._busy.add(start, end)
                if self._recording:
                    self._marks.append((stage, kind, int(chunk), start, end))

        return timed
