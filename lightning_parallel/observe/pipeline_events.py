"""Recording what each pipeline stage does when: forward, backward and weight-gradient actions per micro-batch.

:class:`PipelineEvents` wraps the training stages' ``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk`` (the calls every torch pipelining schedule makes) and the schedule's
``step``. Each schedule step yields its span and the time spent in actions; the rest of the span the rank
waited for other stages (the bubble, including stage-to-stage transfers). The actions of one chosen step
are kept as events for a timeline picture. No Lightning here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    Attributes:
        span_seconds: Wall time inside schedule steps since the last :meth:`take_totals`.
        busy_seconds: Of that, time inside stage actions.
        events: The actions of the step being recorded (see :meth:`record_next_step`).
    """

    def __init__(self) -> None:
        self.span_seconds = 0.0
        self.busy_seconds = 0.0
        self.events: list[StageEvent] = []
        self._recording = False
        self._record_next = False
        self._step_start = 0.0
        self._attached = False

    @property
    def attached(self) -> bool:
        return self._attached

    def attach(self, schedule: Any, stages: list[Any]) -> None:
        """Wrap ``schedule.step`` and each stage's action methods (instance attributes; torch's classes are untouched)."""
        if self._attached:
            return
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
        totals = (self.span_seconds, self.busy_seconds)
        self.span_seconds = self.busy_seconds = 0.0
        return totals

    def _timed_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._recording, self._record_next = self._record_next, False
            if self._recording:
                self.events = []
            self._step_start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self.span_seconds += time.perf_counter() - self._step_start
                self._recording = False

        return timed

    def _timed_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return loss_fn(*args, **kwargs)
            finally:
                self.busy_seconds += time.perf_counter() - start

        return timed

    def _timed_action(self, action: Callable[..., Any], stage: int, kind: str) -> Callable[..., Any]:
        def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return action(chunk, *args, **kwargs)
            finally:
                end = time.perf_counter()
                self.busy_seconds += end - start
                if self._recording:
                    self.events.append(StageEvent(stage, kind, int(chunk), start - self._step_start, end - self._step_start))

        return timed
