"""ScalingMonitor: where each training step's time goes, against what the planner predicted for the layout.

Every optimizer step's wall time (first batch start to last batch end) is split on each rank into

- *data-parallel communication*: the time backward waited for DDP's last gradient bucket to be reduced,
  plus the pipeline replicas' gradient averaging (counted by the strategy's :class:`CommStats`);
- *tensor-parallel communication*: time spent issuing and waiting for DTensor's collectives
  (:class:`~lightning_parallel.measure.collectives.DTensorCollectives`);
- *pipeline bubble*: time inside the schedule not spent in a stage's forward/backward/loss — waiting for
  other stages, and the transfers between them (:class:`~lightning_parallel.observe.pipeline_events.PipelineEvents`);
- *compute*: the rest (forward, backward, optimizer, framework).

FSDP2's collectives (sharded data parallelism) have no hook and count as compute. Throughput is logged as
``scaling/tokens_per_s`` (global and ``_per_device``) and, given a model profile and hardware, model FLOPs
utilisation as ``scaling/mfu`` (:mod:`~lightning_parallel.observe.utilization`). Steps after the warm-up
are logged to the Trainer's loggers under ``scaling/``; when training ends a table compares the means with
the planner's prediction for the same layout (given a model profile and hardware), the figures go to
``scaling.json`` and, under pipeline parallelism, a timeline of one step to ``pipeline_timeline.png``.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import DTensorCollectives
from lightning_parallel.measure.device_clock import DeviceClock, Mark
from lightning_parallel.measure.peak_memory import PeakMemory
from lightning_parallel.observe.utilization import (
    Utilization,
    model_flops_per_sample,
    tokens_in,
    training_dtype,
    utilization,
)
from lightning_parallel.observe.pipeline_events import PipelineEvents, StageEvent
from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.layouts import Layout


@dataclass(frozen=True)
class StepTiming:
    """One optimizer step on one rank, in seconds (bytes handed to collectives alongside)."""

    step_s: float
    compute_s: float
    dp_s: float
    tp_s: float
    bubble_s: float
    pipeline_span_s: float
    samples: int
    dp_bytes: int
    tp_bytes: int
    tokens: int = 0
    cp_s: float = 0.0  # context parallelism's ring attention and output gathers, exposed
    cp_bytes: int = 0
    ep_s: float = 0.0  # expert parallelism's token all-to-alls (dispatch and combine, forward and backward), exposed
    ep_bytes: int = 0
    #: Expert parallelism: the busiest expert's tokens over the mean, averaged over the step's MoE layer calls
    #: (this rank's routing; 0 without expert parallelism).
    expert_imbalance: float = 0.0
    #: Context parallelism: attention scores this rank computed and skipped (masked blocks) in the step, and the
    #: busiest cp rank's expected work over the mean for the step's chunk layouts (0: no packed documents seen).
    cp_scores_computed: float = 0.0
    cp_scores_skipped: float = 0.0
    cp_imbalance: float = 0.0


class ScalingMonitor(Callback):
    """Measure compute, exposed communication and pipeline bubble per step, and compare with the prediction.

    Args:
        enabled: ``False`` turns every hook into a no-op (the recipes' ``scaling_monitor=false``).
        hardware: Profile to predict for (a :class:`HardwareProfile` or its mapping, as in ``conf/hardware``).
        profile: The model's dry run (:func:`~lightning_parallel.plan.profile.profile_model`); with
            ``hardware`` it gives the prediction the end-of-training table compares with.
        warmup_steps: First optimizer steps left out of the means (the first one builds pipelines and caches).
        timeline_step: Optimizer step whose pipeline actions are drawn (default: the first after warm-up).
        output_dir: Where ``scaling.json`` and the timeline go (default: the Trainer's log dir or root dir).
    """

    def __init__(
        self,
        enabled: bool = True,
        hardware: HardwareProfile | dict[str, Any] | None = None,
        profile: Any = None,
        warmup_steps: int = 1,
        timeline_step: int | None = None,
        output_dir: str | Path | None = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"ScalingMonitor(enabled=...) must be True or False, got {enabled!r}.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"ScalingMonitor(warmup_steps={warmup_steps!r}) must be a non-negative int.")
        self.enabled = enabled
        self.hardware = HardwareProfile.from_config(hardware) if isinstance(hardware, dict) else hardware
        self.profile = profile
        self.warmup_steps = warmup_steps
        self.timeline_step = timeline_step if timeline_step is not None else warmup_steps
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.steps: list[StepTiming] = []
        self.summary: dict[str, Any] = {}
        self._collectives = DTensorCollectives()
        self._pipeline = PipelineEvents()
        self._exit = ExitStack()
        self._step_start: dict[str, float] = {}
        self._clock = DeviceClock("cpu")
        self._step_mark: Mark = 0.0
        self._samples = 0
        self._tokens = 0
        self._batch_rows = 0
        self._mfu_warned = False
        self._peak_memory = PeakMemory()

    def not_counted(self) -> Any:
        """Context manager: DTensor collectives issued inside are left out (your own metrics, debugging gathers)."""
        return self._collectives.paused()

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before the strategy sets the model up: the peak memory per rank counts setup, as the prediction does.
        if self.enabled and stage == "fit":
            self._peak_memory.start(pl_module, trainer.strategy.root_device)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        self.steps, self.summary = [], {}
        chosen_on = getattr(trainer.strategy, "model_profile", None)
        if chosen_on is not None:
            # strategy=auto chose the layout on its own dry run and hardware: compare with what it predicted.
            self.profile, self.hardware = chosen_on, trainer.strategy.hardware
        self._clock = DeviceClock(trainer.strategy.root_device)
        self._collectives.clock = self._clock
        self._exit.enter_context(self._collectives.active())

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.enabled:
            return
        runner = getattr(trainer.strategy, "pipeline_runner", None)
        if runner is not None and runner.built and not self._pipeline.attached:
            self._pipeline.attach(runner.train_schedule, runner.local.train_stages)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            if trainer.global_step == self.timeline_step:
                self._pipeline.record_next_step()
            self._pipeline.take_totals()
            self._step_start = self._counters(trainer)
            self._step_mark = self._clock.mark()
            self._samples = self._tokens = 0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.enabled or not self._step_start:
            return
        rows = extract_batch_size(batch)
        self._samples += rows
        self._tokens += tokens_in(batch)
        self._batch_rows = max(self._batch_rows, rows)
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        # The step's device time (on a GPU: events, read here once per step, the measuring window's edge).
        step_s = self._clock.seconds(self._step_mark, self._clock.mark())
        now, start = self._counters(trainer), self._step_start
        span, busy = self._pipeline.take_totals()
        delta = {key: now[key] - start[key] for key in now}
        delta["time"] = step_s
        bubble = max(0.0, span - busy)
        timing = StepTiming(
            step_s=delta["time"],
            compute_s=max(0.0, delta["time"] - delta["dp_s"] - delta["tp_s"] - delta["cp_s"] - delta["ep_s"] - bubble),
            dp_s=delta["dp_s"],
            tp_s=delta["tp_s"],
            bubble_s=bubble,
            pipeline_span_s=span,
            samples=self._samples,
            dp_bytes=int(delta["dp_bytes"]),
            tp_bytes=int(delta["tp_bytes"]),
            tokens=self._tokens,
            cp_s=delta["cp_s"],
            cp_bytes=int(delta["cp_bytes"]),
            ep_s=delta["ep_s"],
            ep_bytes=int(delta["ep_bytes"]),
            expert_imbalance=delta["ep_imbalance_sum"] / delta["ep_calls"] if delta["ep_calls"] else 0.0,
            cp_scores_computed=delta["cp_scores_computed"],
            cp_scores_skipped=delta["cp_scores_skipped"],
            cp_imbalance=delta["cp_imbalance_sum"] / delta["cp_layouts"] if delta["cp_layouts"] else 0.0,
        )
        self._step_start = {}
        # global_step has advanced past the step just finished.
        if trainer.global_step <= self.warmup_steps:
            return
        self.steps.append(timing)
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0 and trainer.is_global_zero:
            replicas = _replicas(trainer)
            metrics = {f"scaling/{k}": v for k, v in asdict(timing).items() if k.endswith("_s")}
            metrics["scaling/samples_per_s"] = timing.samples * replicas / timing.step_s
            metrics["scaling/samples_per_s_per_replica"] = timing.samples / timing.step_s
            metrics["scaling/efficiency"] = timing.compute_s / timing.step_s
            metrics["scaling/tokens_per_s"] = timing.tokens * replicas / timing.step_s
            metrics["scaling/tokens_per_s_per_device"] = timing.tokens * replicas / timing.step_s / trainer.world_size
            used = self._utilization(trainer, timing.samples * replicas, timing.tokens * replicas, timing.step_s)
            if used is not None:
                metrics["scaling/mfu"] = used.mfu
                metrics["scaling/model_tflops_per_s"] = used.model_tflops_per_s
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        self._exit.close()
        self._peak_memory.stop()
        ranks = _gather(trainer, {"rank": trainer.global_rank, "steps": [asdict(s) for s in self.steps],
                                  "events": [asdict(e) for e in self._pipeline.events],
                                  "peak_memory_bytes": self._peak_memory.peak_bytes(),
                                  "resident_peak_bytes": self._peak_memory.resident_peak_bytes()})
        directory = self._directory(trainer)  # Trainer.log_dir is a collective: every rank asks
        if not trainer.is_global_zero:
            return
        measured = _means(ranks[0]["steps"], _replicas(trainer))
        if measured:
            replicas = _replicas(trainer)
            measured["tokens_per_s_per_device"] = measured["tokens_per_s"] / trainer.world_size
            used = self._utilization(trainer, measured["samples"] * replicas, measured["tokens"] * replicas, measured["step_s"])
            if used is not None:
                measured.update(mfu=used.mfu, model_tflops_per_s=used.model_tflops_per_s,
                                peak_tflops_per_device=used.peak_tflops_per_device, mfu_dtype=used.dtype,
                                peak_measured=used.measured_peak)
            peaks = [r["peak_memory_bytes"] for r in ranks]
            if all(p is not None for p in peaks):  # the rank that decides whether a layout fits: the largest
                measured["peak_memory_bytes"] = max(peaks)
            resident = [r["resident_peak_bytes"] for r in ranks]
            if all(p is not None for p in resident):
                measured["resident_peak_bytes"] = max(resident)
        prediction = self._predict(trainer)
        self.summary = {
            "layout": _describe(trainer),
            "world_size": trainer.world_size,
            "measured": measured,
            "measured_by_rank": [_means(r["steps"], _replicas(trainer)) for r in ranks],
            "peak_memory_bytes_by_rank": [r["peak_memory_bytes"] for r in ranks],
            "resident_peak_bytes_by_rank": [r["resident_peak_bytes"] for r in ranks],
            "predicted": prediction.as_dict() if prediction is not None else None,
        }
        directory.mkdir(parents=True, exist_ok=True)
        timeline = self._draw_timeline(trainer, ranks, directory)
        if timeline is not None:
            self.summary["timeline"] = str(timeline)
        (directory / "scaling.json").write_text(json.dumps(self.summary, indent=2, default=str))
        if measured:
            from lightning_parallel.observe.scaling_table import print_scaling_table

            print_scaling_table(self.summary)
        else:
            rank_zero_info(f"ScalingMonitor: no steps after the {self.warmup_steps} warm-up step(s) to report.")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._exit.close()  # never leave torch's collectives wrapped after a failed fit
        self._peak_memory.stop()  # nor the memory sampling thread running

    # ------------------------------------------------------------------ pieces

    def _counters(self, trainer: Trainer) -> dict[str, float]:
        comm = getattr(trainer.strategy, "comm_stats", None)
        tally = self._collectives.tally
        ep_calls, ep_imbalance_sum, _ = self._collectives.expert_load.read()
        return {
            "dp_s": comm.exposed_seconds if comm is not None else 0.0,
            "dp_bytes": comm.bytes if comm is not None else 0,
            "tp_s": tally.seconds,
            "tp_bytes": tally.bytes,
            "cp_s": self._collectives.context_tally.seconds,
            "cp_bytes": self._collectives.context_tally.bytes,
            "ep_s": self._collectives.expert_tally.seconds,
            "ep_bytes": self._collectives.expert_tally.bytes,
            "ep_calls": ep_calls,
            "ep_imbalance_sum": ep_imbalance_sum,
            "cp_scores_computed": self._collectives.context_work.scores_computed,
            "cp_scores_skipped": self._collectives.context_work.scores_skipped,
            "cp_layouts": self._collectives.context_work.layouts,
            "cp_imbalance_sum": self._collectives.context_work.imbalance_sum,
        }

    def _utilization(self, trainer: Trainer, samples: float, tokens: float, step_s: float) -> Utilization | None:
        """MFU and throughput of ``samples`` trained globally in ``step_s`` (``None`` without profile and hardware)."""
        if self.profile is None or self.hardware is None or step_s <= 0:
            return None
        try:
            dtype = training_dtype(trainer.precision)
            used = utilization(model_flops_per_sample(self.profile), samples, tokens, step_s, trainer.world_size,
                               self.hardware, dtype, processes_on_node=trainer.num_devices)
        except ValueError as error:
            if not self._mfu_warned:
                rank_zero_warn(f"ScalingMonitor: no MFU ({error})")
                self._mfu_warned = True
            return None
        if used.mfu > 1 and not self._mfu_warned:
            rank_zero_warn(f"ScalingMonitor: MFU {used.mfu:.2f} > 1 is impossible; a FLOP count or the peak is wrong.")
            self._mfu_warned = True
        return used

    def _predict(self, trainer: Trainer) -> Any:
        if self.profile is None or self.hardware is None or not self._batch_rows:
            return None
        from lightning_parallel.plan.cost import predict
        from lightning_parallel.plan.layouts import Workload

        layout = _planned_layout(trainer)
        accumulate = trainer.accumulate_grad_batches
        built_on_meta = getattr(getattr(trainer.strategy, "placement", None), "initial_values", None) is not None
        workload = Workload(trainer.num_devices, trainer.num_nodes, self._batch_rows * layout.dp * accumulate, accumulate, built_on_meta)
        try:
            return predict(self.profile, layout, workload, self.hardware)
        except ValueError as error:
            rank_zero_warn(f"ScalingMonitor: no prediction for {layout.describe()}: {error}")
            return None

    def _directory(self, trainer: Trainer) -> Path:
        if self.output_dir is not None:
            return self.output_dir
        return Path(trainer.log_dir or trainer.default_root_dir)

    def _draw_timeline(self, trainer: Trainer, ranks: list[dict[str, Any]], directory: Path) -> Path | None:
        runner = getattr(trainer.strategy, "pipeline_runner", None)
        if runner is None:
            return None
        by_rank = {r["rank"]: [StageEvent(**e) for e in r["events"]] for r in ranks}
        rows = {f"pp rank {i} (rank {g})": by_rank.get(g, []) for i, g in enumerate(runner.pp_global_ranks)}
        if not any(rows.values()):
            return None
        from lightning_parallel.observe.plots import render_timeline

        path = directory / "pipeline_timeline.png"
        title = f"{_describe(trainer)} · optimizer step {self.timeline_step}"
        render_timeline(rows, path, title)
        return path


def _replicas(trainer: Trainer) -> int:
    if trainer.world_size == 1:
        return 1
    return int(trainer.strategy.distributed_sampler_kwargs.get("num_replicas", trainer.world_size))


def _planned_layout(trainer: Trainer) -> Layout:
    """The running layout in the planner's terms; Lightning's own strategies: every process a replica."""
    planned = getattr(trainer.strategy, "planned_layout", None)
    return planned() if planned is not None else Layout(dp=trainer.world_size, tp=1, pp=1)


def _describe(trainer: Trainer) -> str:
    return _planned_layout(trainer).describe()


def _gather(trainer: Trainer, payload: dict[str, Any]) -> list[dict[str, Any]]:
    if trainer.world_size == 1 or not dist.is_initialized():
        return [payload]
    gathered = collectives.all_gather_object(payload)
    return sorted(gathered, key=lambda r: r["rank"])


def _means(steps: list[dict[str, Any]], replicas: int) -> dict[str, float]:
    """Means over the recorded steps of one rank, with throughput and the compute share of the step."""
    if not steps:
        return {}
    count = len(steps)
    mean = {key: sum(s[key] for s in steps) / count for key in steps[0]}
    mean["steps"] = count
    mean["samples_per_s"] = mean["samples"] * replicas / mean["step_s"]
    mean["tokens_per_s"] = mean["tokens"] * replicas / mean["step_s"]
    mean["samples_per_s_per_replica"] = mean["samples"] / mean["step_s"]
    mean["efficiency"] = mean["compute_s"] / mean["step_s"]
    mean["bubble_fraction"] = mean["bubble_s"] / mean["pipeline_span_s"] if mean["pipeline_span_s"] else 0.0
    return mean
