"""Compare every layout of a job and pick the one to run: fastest predicted step among those that fit.

:func:`plan` predicts each valid layout (:mod:`~lightning_parallel.plan.cost`), ranks them, and explains
the choice in plain words. It refuses, with the reason, a job no layout can run. No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.plan.cost import Prediction, predict
from lightning_parallel.plan.hardware import GIB, HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload, enumerate_layouts
from lightning_parallel.plan.profile import ModelProfile


class PlanError(ValueError):
    """The request cannot be planned (no layout is valid, or none fits in device memory)."""


@dataclass
class Plan:
    """Ranked predictions (fitting layouts first, each group fastest first) and the recommendation."""

    workload: Workload
    hardware: HardwareProfile
    predictions: list[Prediction]
    rejected: dict[str, str]
    configured: Prediction | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def recommended(self) -> Prediction:
        return self.predictions[0]

    def as_dict(self, model: ModelProfile) -> dict[str, Any]:
        return {
            "model": {"name": model.name, "parameters": model.parameter_count, "trunk_layers": len(model.trunk_layers)},
            "hardware": self.hardware.__dict__,
            "workload": {**self.workload.__dict__, "world_size": self.workload.world_size},
            "recommended": self.recommended.as_dict(),
            "reasons": self.reasons,
            "configured": self.configured.as_dict() if self.configured is not None else None,
            "candidates": [p.as_dict() for p in self.predictions],
            "rejected": self.rejected,
        }


def plan(
    profile: ModelProfile,
    workload: Workload,
    hardware: HardwareProfile,
    fixed: Mapping[str, int] | None = None,
    configured: Layout | None = None,
) -> Plan:
    """Predict every valid layout and rank them.

    Args:
        profile: The model's dry run (with every tensor-parallel degree to consider profiled).
        workload: Ranks, nodes and batch.
        hardware: The device and network.
        fixed: Sizes pinned by the user, e.g. ``{"tp": 2}``.
        configured: The layout the job is configured with, predicted alongside for comparison.

    Raises:
        PlanError: The pinned sizes do not divide the ranks, no layout is valid, or none fits in memory.
    """
    fixed = dict(fixed or {})
    check_request(workload, hardware, fixed)
    layouts, rejected = enumerate_layouts(workload, len(profile.trunk_layers), set(profile.steps), hardware.devices_per_node, fixed,
                                          experts=profile.experts_divisor, expert_lists=profile.expert_lists)
    for key, why in rejected.items():  # a tp degree the dry run found unavailable: its reason, for the user
        degree = re.search(r"\btp=(\d+)", key)
        if degree and int(degree[1]) in profile.tp_invalid and int(degree[1]) not in profile.steps:
            rejected[key] = f"{why}: {profile.tp_invalid[int(degree[1])]}"
    if not layouts:
        reasons = "\n".join(f"  {key}: {why}" for key, why in rejected.items()) or "  (no split of the ranks matches the pinned sizes)"
        raise PlanError(f"No layout of {workload.world_size} ranks can run {profile.name}:\n{reasons}")
    predictions = sorted((predict(profile, layout, workload, hardware) for layout in layouts), key=lambda p: (not p.fits, p.step_s))
    if not predictions[0].fits:
        smallest = min(predictions, key=lambda p: p.peak_memory)
        raise PlanError(
            f"{profile.name} does not fit on {workload.world_size} × {hardware.name} in any layout: the smallest, "
            f"{smallest.layout.describe()}, needs {smallest.peak_memory / GIB:.2f} GiB on its fullest rank, but "
            f"{hardware.usable_memory_bytes / GIB:.2f} GiB are usable per device ({hardware.device_memory_gib:g} GiB less "
            f"{hardware.memory_reserve_fraction:.0%} reserve). Add devices (trainer.devices / trainer.num_nodes), lower "
            f"data.batch_size, or pick a device with more memory."
        )
    configured_prediction = None
    if configured is not None:
        try:
            configured_prediction = predict(profile, configured, workload, hardware)
        except ValueError:
            configured_prediction = None
    result = Plan(workload, hardware, predictions, rejected, configured_prediction)
    result.reasons = explain(result)
    return result


def explain(result: Plan) -> list[str]:
    """Why the recommended layout: memory, each dimension's cost and placement, the runner-up."""
    best, hardware, workload = result.recommended, result.hardware, result.workload
    layout = best.layout
    fullest = max(best.memory, key=lambda m: m.peak)
    held = (
        "during setup: the whole model until the first batch cuts the pipeline (empty_init=true avoids it)"
        if fullest.setup > fullest.total
        else f"{_share(fullest.state, fullest.total)} of it parameters, gradients and optimizer state"
    )
    reasons = [f"fits: {best.peak_memory / GIB:.2f} GiB on the fullest rank of {hardware.usable_memory_bytes / GIB:.2f} GiB usable ({held})"]
    if layout.tp > 1:
        where = "inside a node" if layout.tp <= workload.devices_per_node else "across nodes"
        link = hardware.intra_node_gbps if layout.tp <= workload.devices_per_node else hardware.inter_node_gbps
        reasons.append(
            f"tp={layout.tp} {where}: TP all-reduces activations in every layer, {best.comm_bytes['tp'] / 2**20:.1f} MiB per step, "
            f"so they need the fast links ({link:g} GB/s); they cost {best.tp_s:.3g} s of the {best.step_s:.3g} s step"
        )
    else:
        reasons.append("tp=1: the model's layers fit whole on a device, so no per-layer all-reduces are paid")
    if layout.pp > 1:
        reasons.append(
            f"pp={layout.pp} ({layout.schedule}, {layout.microbatches} micro-batches): bubble {best.bubble_fraction:.0%} of each batch; "
            f"only stage-boundary activations cross ({best.comm_bytes['pp'] / 2**20:.1f} MiB per step), which suits the slower links"
        )
    if layout.cp > 1:
        reasons.append(
            f"cp={layout.cp}: each rank holds 1/{layout.cp} of every sequence's activations; ring attention passes "
            f"{best.comm_bytes['cp'] / 2**20:.1f} MiB of keys/values per step, {best.cp_s:.3g} s ({best.cp_s / best.step_s:.0%} "
            "of the step, overlap not counted)"
        )
    if layout.dp > 1:
        reasons.append(
            f"dp={layout.dp} ({layout.data_parallel_mode}): {best.comm_bytes['dp'] / 2**20:.1f} MiB of gradients per step, "
            f"{best.dp_s:.3g} s ({best.dp_s / best.step_s:.0%} of the step)"
        )
    reasons.append(
        f"predicted speedup {best.speedup:.2f}× on {best.world_size} devices: efficiency {best.efficiency:.0%} "
        f"(S = T_compute / (T_compute/k + T_comm + bubble))"
    )
    fastest = min(result.predictions, key=lambda p: p.step_s)
    if not fastest.fits:
        reasons.append(
            f"faster but out of memory: {fastest.layout.describe()} ({fastest.step_s:.3g} s) needs {fastest.peak_memory / GIB:.2f} GiB"
        )
    runner_up = next((p for p in result.predictions[1:] if p.fits and p.layout.describe() != layout.describe()), None)
    if runner_up is not None:
        reasons.append(f"next best: {runner_up.layout.describe()}, {runner_up.step_s / best.step_s - 1:+.0%} step time")
    return reasons


def check_request(workload: Workload, hardware: HardwareProfile, fixed: Mapping[str, int]) -> None:
    """Refuse what no dry run can fix: pinned sizes that do not divide the ranks, more processes than a node has.

    Raises:
        PlanError: Naming the setting and what to change.
    """
    world = workload.world_size
    where = f"trainer.devices={workload.devices_per_node} × trainer.num_nodes={workload.num_nodes}"
    for dim, size in fixed.items():
        if dim not in ("dp", "cp", "tp", "pp", "ep"):
            raise PlanError(f"Only dp, cp, tp, pp and ep can be pinned, got {dim!r}.")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
            raise PlanError(f"{dim}={size!r} does not divide the world size {world} ({where}); pick a divisor of {world}.")
    product = 1
    for dim, size in fixed.items():
        product *= size if dim != "ep" else 1  # ep borrows dp's ranks
    if world % product:
        raise PlanError(f"The pinned sizes {dict(fixed)} multiply to {product}, which does not divide the world size {world} ({where}).")
    if workload.devices_per_node > hardware.devices_per_node:
        raise PlanError(
            f"trainer.devices={workload.devices_per_node} processes per node, but a {hardware.name} node has "
            f"{hardware.devices_per_node} devices (hardware.devices_per_node). Use more nodes (trainer.num_nodes) instead."
        )


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "0%"
