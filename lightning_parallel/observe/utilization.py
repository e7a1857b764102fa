"""Model FLOPs utilisation (MFU) and tokens per second of training steps.

MFU = model FLOPs of the step / (step time × devices × one device's peak in the training dtype). The
model FLOPs are the whole model's forward + backward for the step's global batch, from the planner's dry
run (``torch.utils.flop_counter`` on the meta device, tensor-parallel degree 1: nothing is counted twice
under TP or PP); work recomputed by activation checkpointing is not useful work and is not counted. The
peak must be the training dtype's (bf16 for ``bf16-mixed``): a profile without it is refused rather than
divided by another dtype's. An MFU above 1 is a bug in one of these figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.profile import ModelProfile

#: Lightning's ``precision`` -> the dtype matmuls run in (what the peak must be given for).
PRECISION_DTYPES = {
    "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16": "bf16",
    "16-mixed": "fp16", "16-true": "fp16", "16": "fp16",
    "32-true": "fp32", "32": "fp32",
    "64-true": "fp64", "64": "fp64",
}


def training_dtype(precision: Any) -> str:
    """The dtype name a Lightning ``precision`` setting computes in (``bf16-mixed`` -> ``bf16``).

    Raises:
        ValueError: A precision this module does not know (e.g. ``transformer-engine``).
    """
    name = str(precision)
    if name not in PRECISION_DTYPES:
        raise ValueError(f"precision={name!r} has no known compute dtype for MFU; known: {sorted(PRECISION_DTYPES)}.")
    return PRECISION_DTYPES[name]


def model_flops_per_sample(profile: ModelProfile) -> float:
    """Forward + backward FLOPs of the whole model per sample (no recomputation, tensor-parallel degree 1)."""
    return float(sum(profile.step(1).flops.values()))


def tokens_in(batch: Any) -> int:
    """Tokens in a batch: the elements of its first integer tensor of two or more dimensions (token ids),
    else its rows (one sample, one "token")."""
    tensors = _tensors(batch)
    for tensor in tensors:
        if not tensor.is_floating_point() and not tensor.is_complex() and tensor.dim() >= 2:
            return tensor.numel()
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1


@dataclass(frozen=True)
class Utilization:
    """Throughput and MFU of one step (or the mean of several), over all devices."""

    tokens_per_s: float
    tokens_per_s_per_device: float
    model_tflops_per_s: float
    mfu: float
    peak_tflops_per_device: float
    dtype: str
    measured_peak: bool


def utilization(
    flops_per_sample: float, samples: float, tokens: float, step_s: float, devices: int, hardware: HardwareProfile, dtype: str,
    processes_on_node: int,
) -> Utilization:
    """MFU and tokens/s of a step that trained ``samples`` (``tokens``) globally in ``step_s`` on ``devices``.

    Raises:
        ValueError: The hardware profile has no peak for ``dtype``.
    """
    peak = hardware.peak_flops(dtype, processes_on_node)
    model_flops_per_s = flops_per_sample * samples / step_s
    return Utilization(
        tokens_per_s=tokens / step_s,
        tokens_per_s_per_device=tokens / step_s / devices,
        model_tflops_per_s=model_flops_per_s / 1e12,
        mfu=model_flops_per_s / (devices * peak),
        peak_tflops_per_device=peak / 1e12,
        dtype=dtype,
        measured_peak=hardware.measured_peak,
    )


def check_mfu(value: float, where: str) -> None:
    """Refuse an MFU above 1: more useful FLOPs than the hardware can do means a figure is wrong.

    Raises:
        RuntimeError: Naming the likely causes.
    """
    if value > 1.0:
        raise RuntimeError(
            f"{where}: MFU {value:.2f} > 1 is impossible. The model FLOPs are counted twice (TP/PP), the peak is for "
            f"another dtype than training's, or the step time does not cover the step."
        )


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for value in batch.values() for t in _tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in _tensors(value)]
    return []
