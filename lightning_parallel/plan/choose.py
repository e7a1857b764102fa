"""Choosing the layout for a module about to train: the planner's dry run of a meta copy of it, for the job's ranks.

This is what ``strategy=auto`` (:class:`~lightning_parallel.strategies.auto.AutoParallelStrategy`) runs on rank 0
before any process group exists; ``python -m lightning_parallel.plan`` runs the same planner from a Hydra config.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from lightning_parallel.plan.cost import Prediction
from lightning_parallel.plan.hardware import GIB, HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload, tensor_parallel_sizes
from lightning_parallel.plan.planner import Plan, PlanError, plan
from lightning_parallel.plan.profile import ModelProfile, profile_model


@dataclass(frozen=True)
class Choice:
    """The layout chosen for a job, and what the planner predicted for it."""

    prediction: Prediction
    plan: Plan
    profile: ModelProfile
    skipped: tuple[str, ...] = ()  # faster layouts the strategy refused, each with the reason

    @property
    def layout(self) -> Layout:
        return self.prediction.layout

    def report(self) -> list[str]:
        """Lines for the launch log: the layout, its predicted figures, why it was chosen."""
        best, workload, hardware = self.prediction, self.plan.workload, self.plan.hardware
        lines = [
            f"strategy=auto chose {best.layout.describe()} for {workload.world_size} ranks "
            f"({workload.num_nodes} node(s) × {workload.devices_per_node}) on {hardware.name}: "
            f"{len(self.plan.predictions)} layouts compared, {sum(not p.fits for p in self.plan.predictions)} out of memory",
            f"  predicted: {best.step_s:.3g} s per optimizer step, {best.samples_per_s:.4g} samples/s, "
            f"{best.peak_memory / GIB:.2f} GiB on the fullest rank of {hardware.usable_memory_bytes / GIB:.2f} usable, "
            f"speedup {best.speedup:.2f}× (efficiency {best.efficiency:.0%})",
            f"  batch: {best.batch_size} samples per replica per forward × {best.layout.dp} replicas × "
            f"{workload.accumulate} accumulated = global batch {workload.global_batch}",
        ]
        lines += [f"  • {reason}" for reason in self.plan.reasons if self.plan.recommended is best]
        lines += [f"  skipped {reason}" for reason in self.skipped]
        return lines


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (nothing allocated, ties kept).

    The module itself is untouched; a Lightning trainer it is attached to is not copied.

    Raises:
        TypeError: The module cannot be deep-copied (an attribute refuses it); the error names the cause.
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    for attachment in ("_trainer", "_fabric"):
        attached = module.__dict__.get(attachment)
        if attached is not None:
            memo[id(attached)] = None
    try:
        return copy.deepcopy(module, memo)
    except Exception as error:  # noqa: BLE001 — any attribute's __deepcopy__ may refuse; say which, as a TypeError
        raise TypeError(
            f"The planner dry-runs a meta-device copy of {type(module).__name__}, but copy.deepcopy of it failed "
            f"({type(error).__name__}: {error}). Make the module's attributes copyable, or choose the layout yourself "
            "(HybridParallelStrategy with explicit sizes; `python -m lightning_parallel.plan` shows the planner's ranking)."
        ) from error


def choose_layout(
    module: nn.Module,
    batch: Any,
    workload: Workload,
    hardware: HardwareProfile,
    fixed: Mapping[str, int] | None = None,
    tensor_parallel: TensorParallelConfig | None = None,
    dtype: torch.dtype | None = None,
    refuse: Callable[[Layout], str | None] = lambda _: None,
) -> Choice:
    """The fastest predicted layout that fits in memory and that ``refuse`` accepts.

    Args:
        module: The LightningModule about to train (copied to the meta device; not modified).
        batch: One training batch (its shapes drive the dry run).
        workload: Ranks, nodes, global batch and accumulation.
        hardware: The device and network to predict for.
        fixed: Sizes the user pinned, e.g. ``{"tp": 2}``.
        tensor_parallel: The tensor-parallel plan the strategy will use.
        dtype: The dtype training keeps parameters in (``None``: the module's own).
        refuse: The strategy's own check of a layout: the reason it cannot run it, or ``None``.

    Raises:
        PlanError: No layout is valid, none fits in memory, or ``refuse`` refuses every one that fits.
    """
    fixed = dict(fixed or {})
    sizes = tensor_parallel_sizes(workload.world_size, fixed)
    profile = profile_model(lambda: meta_copy(module), batch, sizes, tensor_parallel, dtype)
    result = plan(profile, workload, hardware, fixed)
    skipped: list[str] = []
    for prediction in (p for p in result.predictions if p.fits):
        reason = refuse(prediction.layout)
        if reason is None:
            return Choice(prediction, result, profile, tuple(skipped))
        skipped.append(f"{prediction.layout.describe()} ({prediction.step_s:.3g} s predicted): {reason}")
    raise PlanError(
        f"Every layout of {workload.world_size} ranks that fits {profile.name} in memory is refused:\n  "
        + "\n  ".join(skipped)
    )
