"""Lightning's own callbacks under the engine, where they read the model or count devices as one device would not.

* ``BaseFinetuning`` (``BackboneFinetuning``...) decides which parameters to add to the optimizer when it unfreezes by
  comparing them by value with every parameter already there (``torch.equal``): a DTensor against a plain tensor
  stops (*"aten.equal.default got mixed torch.Tensor and DTensor"*). Each such callback gets :func:`filter_on_optimizer`
  for the run: the same comparison on whole values.
* ``ThroughputMonitor`` multiplies one device's samples by the world size: under tensor or pipeline parallelism ranks
  share their samples, and the global figures were ``tp x pp`` times too high. Its meters count the data-parallel
  replicas instead (:class:`ReplicaThroughput`); FLOPs still divide over every device.
  Under DDP replicas (``data_parallel_mode='replicate'``) such a callback is refused: DDP averages only the gradients
  of the parameters that required one when it wrapped the model, before the callback unfreezes them.
* ``StochasticWeightAveraging`` keeps a deep copy of the whole, unsplit module and pairs its tensors with the module's
  by position (shards, or one stage's): refused with the fix, ``WeightAveraging``, which the engine keeps sharded.
* ``ModelPruning`` re-parametrises each weight (``weight_orig`` x ``weight_mask``) and ranks magnitudes over what the
  rank holds: under FSDP2 or tensor parallelism that breaks the sharded parameters, under pipeline parallelism it ranks
  one stage's weights only (not what one device prunes). Refused with the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    ModelPruning,
    StochasticWeightAveraging,
    ThroughputMonitor,
)
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``BaseFinetuning.filter_on_optimizer`` on whole values: the parameters of ``params`` equal to none in
    ``optimizer`` (Lightning compares values, as here; DTensors are gathered, so every rank of their mesh calls it)."""
    out = []
    held = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        same = any(p is param or (p.shape == param.shape and torch.equal(_whole(p), _whole(param))) for p in held)
        if not same:
            out.append(param)
    return out


class ReplicaThroughput(Throughput):
    """Lightning's throughput meter counting ``replicas`` data-parallel replicas (each its own samples) among
    ``world_size`` devices: global samples/batches are one replica's times ``replicas``; FLOPs (one replica's batch)
    are summed over replicas and divided over every device for the per-device figures and MFU."""

    def __init__(self, replicas: int, world_size: int, **kwargs: Any) -> None:
        super().__init__(world_size=replicas, **kwargs)
        self.devices = world_size

    def compute(self) -> dict[str, Any]:
        metrics = super().compute()
        per_device = f"device{self.separator}flops_per_sec"
        if per_device in metrics:
            metrics[per_device] = metrics[per_device] * self.world_size / self.devices
            if self.available_flops:
                metrics[f"device{self.separator}mfu"] = metrics[per_device] / self.available_flops
        return metrics


def check(engine: EngineHost, trainer: Trainer | None) -> None:
    """Before the callbacks' setup: refuse the callbacks that cannot see a split model, naming the fix."""
    if trainer is None:
        return
    split = engine.parameters_are_dtensors or engine.pipeline_parallel.enabled
    if not split and engine.layout.data_parallel_size > 1:
        _check_replicas(trainer)
    if not split:
        return
    how = "pipeline stages" if engine.pipeline_parallel.enabled else "DTensor shards (sharded data parallelism, tensor or expert parallelism)"
    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            raise ValueError(  # noqa: TRY004 - a callback that this layout cannot run: a configuration error
                f"StochasticWeightAveraging keeps a deep copy of the whole, unsplit module and cannot average its "
                f"{how}. Use lightning.pytorch.callbacks.WeightAveraging() (equal averages, as SWA's; kept sharded like "
                f"the model) and, for SWA's learning rate, torch.optim.swa_utils.SWALR in configure_optimizers."
            )
        if isinstance(callback, ModelPruning):
            raise ValueError(  # noqa: TRY004 - a callback that this layout cannot run: a configuration error
                f"ModelPruning re-parametrises weights and ranks their magnitudes over what one rank holds: with {how} "
                f"that is not what one device prunes. Prune under data_parallel_mode='replicate' (DDP) or on one device "
                f"and load the pruned weights (weights_from=...), or apply torch.nn.utils.prune to the model before fit "
                f"and make the pruning permanent (prune.remove) so the strategy splits plain weights."
            )


def _check_replicas(trainer: Trainer) -> None:
    """DDP replicas: DDP averages the gradients of the parameters that require one when it wraps the module, and
    BaseFinetuning freezes in its setup (before the wrap) and unfreezes later: those gradients would stay each
    replica's own, and the replicas drift apart."""
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning):
            raise ValueError(  # noqa: TRY004 - a callback that this layout cannot run: a configuration error
                f"{type(callback).__name__} unfreezes parameters during training, but DDP (data_parallel_mode="
                f"'replicate') averages only the gradients of parameters that required one when it wrapped the model: "
                f"the unfrozen ones would differ between replicas. Use data_parallel_mode='shard' (FSDP2 averages every "
                f"gradient it finds), or unfreeze before fit."
            )


def attach(engine: EngineHost, trainer: Trainer | None) -> None:
    """After setup: the finetuning callbacks compare whole values, throughput counts replicas."""
    if trainer is None:
        return
    split = engine.parameters_are_dtensors or engine.pipeline_parallel.enabled
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and split:
            callback.filter_on_optimizer = filter_on_optimizer  # an instance attribute: this callback, this run
        if isinstance(callback, ThroughputMonitor):
            replicas = engine.layout.data_parallel_size
            # The callback made its meters in its setup (before this one) with world_size=trainer.world_size.
            for stage, meter in list(callback._throughputs.items()):
                if not isinstance(meter, ReplicaThroughput):
                    callback._throughputs[stage] = ReplicaThroughput(
                        replicas, trainer.world_size, available_flops=callback.available_flops, **callback.kwargs
                    )


def detach(trainer: Trainer | None) -> None:
    """At teardown: the callbacks' own methods again."""
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, BaseFinetuning):
            callback.__dict__.pop("filter_on_optimizer", None)
