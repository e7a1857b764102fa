"""Comparing the planner's predictions with what a test job measured (state bytes, communication bytes)."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest

from lightning_parallel.plan.config import parameter_dtype
from lightning_parallel.plan.cost import Prediction, predict
from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload
from lightning_parallel.plan.profile import ModelProfile, profile_model
from tests.harness import JobSpec, make_data, make_model

#: The prediction of bytes does not depend on the hardware; times are not compared here.
ANY_HARDWARE = HardwareProfile(name="any", device_memory_gib=80, peak_tflops=100, achievable_fraction=0.5,
                               devices_per_node=8, intra_node_gbps=100, inter_node_gbps=10)
#: The issue's bar: predictions within 5% of the measurement.
REL = 0.05


def first_batch(spec: JobSpec) -> Any:
    """The first training batch of ``spec``'s data."""
    data = make_data(spec)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


@cache
def _profile(model: str, n_layer: int, n_embd: int, tie_weights: bool, batch_size: int, precision: str, tp: int) -> ModelProfile:
    spec = JobSpec(model=model, n_layer=n_layer, n_embd=n_embd, tie_weights=tie_weights, batch_size=batch_size, precision=precision)
    return profile_model(lambda: make_model(spec), first_batch(spec), (1, tp), dtype=parameter_dtype(precision))


def layout_of(spec: JobSpec) -> Layout:
    """The planner's layout for a test job (sizes filled as the strategy presets fill them)."""
    kwargs = spec.strategy_kwargs
    names = {"dp": "data_parallel_size", "cp": "context_parallel_size", "tp": "tensor_parallel_size",
             "pp": "pipeline_parallel_size"}
    fill = {"data": "dp", "tensor": "tp", "pipeline": "pp"}.get(spec.strategy, "dp")
    sizes = {dim: kwargs.get(name, -1 if dim == fill else 1) for dim, name in names.items()}
    known = math.prod(size for size in sizes.values() if size != -1)
    sizes = {dim: spec.devices // known if size == -1 else size for dim, size in sizes.items()}
    mode = kwargs.get("data_parallel_mode", "replicate") if sizes["dp"] > 1 else "replicate"
    pipelined = sizes["pp"] > 1
    return Layout(
        dp=sizes["dp"], tp=sizes["tp"], pp=sizes["pp"], data_parallel_mode=mode,
        shard_size={"shard": sizes["dp"], "hybrid_shard": kwargs.get("data_parallel_shard_size", 1)}.get(mode, 1),
        schedule=kwargs.get("schedule", "1f1b") if pipelined else "none",
        stages_per_rank=kwargs.get("stages_per_rank", 1) if pipelined else 1,
        microbatches=kwargs.get("microbatches", 4) if pipelined else 1,
        activation_checkpointing=bool(kwargs.get("activation_checkpointing")), cp=sizes["cp"],
        ep=kwargs.get("expert_parallel_size", 1),
    )


def prediction_for(spec: JobSpec) -> Prediction:
    layout = layout_of(spec)
    profile = _profile(spec.model, spec.n_layer, spec.n_embd, spec.tie_weights, spec.batch_size, spec.precision, layout.tp)
    workload = Workload(devices_per_node=spec.devices, num_nodes=1, global_batch=spec.batch_size * layout.dp * spec.accumulate,
                        accumulate=spec.accumulate)
    return predict(profile, layout, workload, ANY_HARDWARE)


def assert_planner_predicts_state(spec: JobSpec, result: dict[str, Any]) -> None:
    """Rank 0's parameters, gradients and optimizer state as predicted, within 5%."""
    predicted = prediction_for(spec).memory[0]
    measured = result["state_bytes"]
    assert predicted.parameters == pytest.approx(measured["parameters"], rel=REL)
    assert predicted.gradients == pytest.approx(measured["gradients"], rel=REL)
    assert predicted.optimizer == pytest.approx(measured["optimizer"], rel=REL)


def assert_planner_predicts_communication(spec: JobSpec, result: dict[str, Any], dims: tuple[str, ...]) -> None:
    """Bytes per optimizer step the monitor counted on rank 0 (every step), as predicted within 5%."""
    predicted = prediction_for(spec).comm_bytes
    steps = result["scaling_steps"]
    assert steps, "the job ran without a ScalingMonitor (JobSpec.monitor=True)"
    for dim in dims:
        measured = [step[f"{dim}_bytes"] for step in steps]
        assert measured[0] > 0, dim
        for value in measured:
            assert predicted[dim] == pytest.approx(value, rel=REL), dim
