"""Pipeline schedules by name: which torch schedule, how many stages each rank holds, where stages live.

Every schedule ``torch.distributed.pipelining`` provides is available under a short name. Single-stage
schedules (``gpipe``, ``1f1b``) put one stage on each rank; the others need ``stages_per_rank >= 2``
virtual stages per rank, placed round-robin ("loop": rank r holds stages r, r+pp, ...) or in a V
(``zbv_zero_bubble``, ``dualpipev``: rank r holds stages r and 2·pp−1−r). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch.distributed.pipelining import schedules as torch_schedules


@dataclass(frozen=True)
class ScheduleSpec:
    """What one named schedule needs.

    Attributes:
        torch_name: The class name torch gives it.
        multi_stage: Takes several stages per rank (interleaved/looped/zero-bubble/V schedules).
        placement: ``"loop"`` (round-robin) or ``"v"`` (rank r holds r and 2·pp−1−r).
        exact_stages_per_rank: Stages per rank the schedule requires, if it requires a number.
        min_microbatches_per_stage: Micro-batches needed per stage *in total* (``m >= this × stages``).
    """

    torch_name: str
    multi_stage: bool
    placement: Literal["loop", "v"] = "loop"
    exact_stages_per_rank: int | None = None
    min_microbatches_per_stage: int = 0

    @property
    def torch_class(self) -> type:
        return getattr(torch_schedules, f"Schedule{self.torch_name}")


#: Schedule names accepted by ``schedule=``.
SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("GPipe", multi_stage=False),
    "1f1b": ScheduleSpec("1F1B", multi_stage=False, min_microbatches_per_stage=1),
    "interleaved_1f1b": ScheduleSpec("Interleaved1F1B", multi_stage=True),
    "looped_bfs": ScheduleSpec("LoopedBFS", multi_stage=True),
    "interleaved_zero_bubble": ScheduleSpec("InterleavedZeroBubble", multi_stage=True),
    "zbv_zero_bubble": ScheduleSpec(
        "ZBVZeroBubble", multi_stage=True, placement="v", exact_stages_per_rank=2
    ),
    "dualpipev": ScheduleSpec(
        "DualPipeV",
        multi_stage=True,
        placement="v",
        exact_stages_per_rank=2,
        min_microbatches_per_stage=1,
    ),
}


def check_schedule(name: str, pipeline_parallel_size: int, stages_per_rank: int, microbatches: int) -> ScheduleSpec:
    """Validate a schedule request before any process starts; returns its spec.

    Raises:
        ValueError: Unknown name, a virtual-stage count the schedule cannot use, or too few micro-batches.
    """
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ValueError(f"schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}.")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a positive int (micro-batches per batch).")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank={stages_per_rank!r} must be a positive int.")
    if not spec.multi_stage and stages_per_rank != 1:
        raise ValueError(
            f"schedule={name!r} runs one stage per rank, but stages_per_rank={stages_per_rank}. Set stages_per_rank=1, "
            f"or pick a virtual-stage schedule (interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble, "
            f"dualpipev)."
        )
    if spec.multi_stage and stages_per_rank < 2:
        raise ValueError(
            f"schedule={name!r} interleaves virtual stages and needs stages_per_rank >= 2 (got {stages_per_rank}). "
            f"Set stages_per_rank=2, or use schedule=1f1b / gpipe for one stage per rank."
        )
    if spec.exact_stages_per_rank is not None and stages_per_rank != spec.exact_stages_per_rank:
        raise ValueError(
            f"schedule={name!r} places exactly {spec.exact_stages_per_rank} stages on each rank (a V shape), but "
            f"stages_per_rank={stages_per_rank}. Set stages_per_rank={spec.exact_stages_per_rank}."
        )
    if pipeline_parallel_size > 1:
        stages = pipeline_parallel_size * stages_per_rank if spec.multi_stage else pipeline_parallel_size
        needed = spec.min_microbatches_per_stage * stages
        if microbatches < needed:
            raise ValueError(
                f"schedule={name!r} with {stages} stages needs at least {needed} micro-batches per batch, but "
                f"microbatches={microbatches}. Raise microbatches to {needed} or more (the batch size must divide by it)."
            )
    return spec


def stage_ranks(spec: ScheduleSpec, pipeline_parallel_size: int, num_stages: int) -> list[int]:
    """The pipeline rank (0..pp−1) that holds each stage index."""
    if spec.placement == "v":
        return [s if s < pipeline_parallel_size else num_stages - 1 - s for s in range(num_stages)]
    return [s % pipeline_parallel_size for s in range(num_stages)]


def stages_on(stage_to_rank: Sequence[int], pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds, in increasing order."""
    return [s for s, r in enumerate(stage_to_rank) if r == pp_rank]


def build_forward_only_schedule(
    stages: Sequence[Any],
    microbatches: int,
    loss_fn: Callable[..., Any] | None,
    stage_to_rank: Sequence[int],
) -> Any:
    """A forward-only schedule for evaluation over the same stages, whatever the training schedule.

    Each rank runs its stages in order, all micro-batches of one stage before the next (GPipe's forward
    half). Torch's V-shaped schedules cannot run forward-only (``eval()`` still steps through their
    backward actions), so evaluation uses this for every schedule; it is built with torch's schedule
    runtime, which adds the sends and receives.
    """
    runtime = torch_schedules._PipelineScheduleRuntime(
        list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False
    )
    placement = dict(enumerate(stage_to_rank))
    # Torch validates action lists for backward actions, which a forward-only list lacks: set the
    # placement and lower the list to sends/receives directly.
    runtime.stage_index_to_group_rank = placement
    for stage in stages:
        stage.stage_index_to_group_rank = placement
    forward = torch_schedules._ComputationType.FORWARD
    actions = {
        rank: [
            torch_schedules._Action(stage, forward, mb)
            for stage in stages_on(stage_to_rank, rank)
            for mb in range(microbatches)
        ]
        for rank in sorted(set(stage_to_rank))
    }
    runtime.pipeline_order_with_comms = torch_schedules._add_send_recv(
        actions, stage_to_rank=lambda s: placement[s], num_stages=len(stage_to_rank)
    )
    return runtime


def build_schedule(
    name: str,
    stages: Sequence[Any],
    microbatches: int,
    loss_fn: Callable[..., Any] | None,
) -> Any:
    """Construct the torch schedule over this rank's stages.

    Gradients are not rescaled by torch (``scale_grads=False``): the loss function weighs each micro-batch
    itself, which keeps partial batches and gradient accumulation exact.

    Raises:
        ValueError: When torch rejects the combination; the message names the fields to change.
    """
    spec = SCHEDULES[name]
    target = list(stages) if spec.multi_stage else stages[0]
    try:
        return spec.torch_class(target, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as error:
        raise ValueError(
            f"schedule={name!r} cannot run with microbatches={microbatches} over {stages[0].num_stages} stages: "
            f"{error} Change microbatches or stages_per_rank."
        ) from error
