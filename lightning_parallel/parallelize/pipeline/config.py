"""Pipeline-parallel options: schedule, micro-batches, virtual stages, where to split. No Lightning here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_parallel.parallelize.pipeline.schedule import (
    SCHEDULES,
    ScheduleSpec,
    check_schedule,
)
from lightning_parallel.parallelize.pipeline.split import BALANCES


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline runs.

    Args:
        schedule: One of :data:`~lightning_parallel.parallelize.pipeline.schedule.SCHEDULES`
            (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``,
            ``zbv_zero_bubble``, ``dualpipev``).
        microbatches: Micro-batches each batch is cut into (the batch size must divide by it).
        stages_per_rank: Virtual stages per rank (2 or more for the interleaved, looped, zero-bubble and
            V schedules; 1 for ``gpipe``/``1f1b``).
        split_points: ``"auto"`` (balanced over the model's layer list) or the module names, relative to
            the LightningModule, where stages 1, 2, ... begin.
        balance: With ``split_points="auto"``: weigh layers by ``"params"`` or by measured ``"time"``.
    """

    schedule: str = "1f1b"
    microbatches: int = 4
    stages_per_rank: int = 1
    split_points: str | Sequence[str] = "auto"
    balance: str = "params"

    def __post_init__(self) -> None:
        check_schedule(self.schedule, 1, self.stages_per_rank, self.microbatches)
        if self.balance not in BALANCES:
            raise ValueError(f"balance={self.balance!r} is unknown; choose one of {', '.join(BALANCES)}.")
        if isinstance(self.split_points, str):
            if self.split_points != "auto":
                raise ValueError(
                    f"split_points={self.split_points!r}: use 'auto' or a list of module names "
                    f"(e.g. ['model.blocks.2'])."
                )
        elif not all(isinstance(p, str) and p for p in self.split_points):
            raise TypeError(f"split_points must be 'auto' or a list of module names, got {self.split_points!r}.")
        else:
            object.__setattr__(self, "split_points", tuple(self.split_points))

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULES[self.schedule]

    def num_stages(self, pipeline_parallel_size: int) -> int:
        """Stages in the whole pipeline."""
        return pipeline_parallel_size * self.stages_per_rank

    def check(self, pipeline_parallel_size: int) -> None:
        """Validate against the resolved pipeline size (micro-batch counts some schedules need)."""
        check_schedule(self.schedule, pipeline_parallel_size, self.stages_per_rank, self.microbatches)
