"""Lightning's own callbacks under the engine, where they read the model or count devices as one device would not.

* ``BaseFinetuning`` (``BackboneFinetuning``...) decides which parameters to add to the optimizer when it unfreezes by
  comparing them by value with every parameter already there (``torch.equal``): a DTensor against a plain tensor
  stops (*"aten.equal.default got mixed torch.Tensor and DTensor"*). While an engine is set up, that static method is
  :func:`filter_on_optimizer` (``unfreeze_and_add_param_group`` calls it through the class): the same comparison on
  whole values, Lightning's own result on plain tensors.
* ``ThroughputMonitor`` multiplies one device's samples by the world size: under tensor or pipeline parallelism ranks
  share their samples, and the global figures were ``tp x pp`` times too high. Its meters count the data-parallel
  replicas instead (:class:`ReplicaThroughput`); FLOPs still divide over every device.
  Under DDP replicas (``data_parallel_mode='replicate'``) such a callback is refused: DDP averages only the gradients
  of the parameters that required one when it wrapped the model, before the callback unfreezes them.
* ``BatchSizeFinder`` / ``Tuner.scale_batch_size``: Lightning refuses distributed strategies (*"The Batch size finder
  is not supported with distributed strategies"*, *"Tuning the batch size is currently not supported with distributed
  strategies"*); refused here first, naming what to do instead (the tuner's check is wrapped when a strategy is made:
  :func:`install_tuner_check`).
* The LR finder (``LearningRateFinder``, ``Tuner.lr_find``) records each step's ``outputs["loss"]``: under data
  parallelism one replica's part of the batch, so its losses and suggestion were not one device's. While an engine is
  set up, its callback's hook gets the mean over the data-parallel replicas (the global batch's loss; one all-reduce
  per step while the finder runs).
* ``StochasticWeightAveraging`` keeps a deep copy of the whole, unsplit module and pairs its tensors with the module's
  by position (shards, or one stage's): refused with the fix, ``WeightAveraging``, which the engine keeps sharded.
* ``ModelPruning`` re-parametrises each weight (``weight_orig`` x ``weight_mask``) and ranks magnitudes over what the
  rank holds: under FSDP2 or tensor parallelism that breaks the sharded parameters, under pipeline parallelism it ranks
  one stage's weights only (not what one device prunes): refused. Under DDP replicas its lottery-ticket reset (on by
  default) assigns each pruned weight data copied before the precision conversion (one device under ``64-true`` ends
  in float32) and training diverged from one device a step later (3e-3 in the loss): refused, naming
  ``use_lottery_ticket_hypothesis=False``. The fix otherwise: prune on one device, or before fit made permanent.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BatchSizeFinder,
    ModelPruning,
    StochasticWeightAveraging,
    ThroughputMonitor,
)
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost

#: Engines set up in this process, and Lightning's own ``BaseFinetuning.filter_on_optimizer`` while they are.
_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()
_LIGHTNING_FILTER: list[Any] = []
#: Lightning's own LR finder ``_LRCallback.on_train_batch_end`` while they are.
_LIGHTNING_LR_BATCH_END: list[Any] = []


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


BATCH_SIZE_FINDER = (
    "BatchSizeFinder (and Tuner.scale_batch_size) runs on one device only: Lightning refuses every distributed strategy. "
    "Find the batch size that fits one rank's share with the planner (python -m lightning_parallel.plan: memory per "
    "rank for each layout), or run the finder on one device with the model that rank holds, and set the data module's "
    "batch_size (per data-parallel replica)."
)


def install_tuner_check() -> None:
    """``Tuner.scale_batch_size`` refuses distributed strategies before any hook of the strategy runs (Lightning's
    ``_check_scale_batch_size_configuration``): for this library's strategies, refuse with :data:`BATCH_SIZE_FINDER`
    (what to do instead) first. Idempotent; other strategies get Lightning's check unchanged."""
    from lightning.pytorch.tuner import tuning

    original = tuning._check_scale_batch_size_configuration
    if getattr(original, "_lightning_parallel", False):
        return

    def check_configuration(trainer: Trainer) -> None:
        if type(trainer.strategy).__module__.startswith("lightning_parallel.") and trainer.world_size > 1:
            raise ValueError(BATCH_SIZE_FINDER)
        original(trainer)

    check_configuration._lightning_parallel = True  # type: ignore[attr-defined]
    tuning._check_scale_batch_size_configuration = check_configuration


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


def _lr_finder_batch_end(self: Any, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
    """The LR finder's ``on_train_batch_end`` given the global batch's loss: the mean over the data-parallel replicas
    when an engine with several trains (every replica runs it at every batch: the all-reduce is matched)."""
    engine = trainer.strategy
    replicas = engine.layout.data_parallel_size if engine in _ENGINES else 1
    loss = outputs if isinstance(outputs, torch.Tensor) else (outputs or {}).get("loss")
    if replicas > 1 and isinstance(loss, torch.Tensor):
        from lightning_parallel import collectives

        mean = collectives.all_reduce(loss.detach().clone(), group=engine.data_parallel_group) / replicas
        outputs = mean if isinstance(outputs, torch.Tensor) else {**outputs, "loss": mean}
    _LIGHTNING_LR_BATCH_END[0](self, trainer, pl_module, outputs, batch, batch_idx)


def check(engine: EngineHost, trainer: Trainer | None) -> None:
    """Before the callbacks' setup: refuse the callbacks that cannot see a split model, naming the fix."""
    if trainer is None:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, BatchSizeFinder) and engine.world_size > 1:
            raise ValueError(BATCH_SIZE_FINDER)
    split = engine.parameters_are_dtensors or engine.pipeline_parallel.enabled
    if not split and engine.layout.data_parallel_size > 1:
        _check_replicas(trainer)
    how = "pipeline stages" if engine.pipeline_parallel.enabled else "DTensor shards (sharded data parallelism, tensor or expert parallelism)"
    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging) and split:
            raise ValueError(
                f"StochasticWeightAveraging keeps a deep copy of the whole, unsplit module and cannot average its "
                f"{how}. Use lightning.pytorch.callbacks.WeightAveraging() (equal averages, as SWA's; kept sharded like "
                f"the model) and, for SWA's learning rate, torch.optim.swa_utils.SWALR in configure_optimizers."
            )
        # Under DDP replicas only its lottery-ticket reset is refused: it assigns each pruned weight data copied before
        # the precision conversion (one device under 64-true ends in float32), which DDP's gradient buckets do not follow.
        resets = bool(getattr(callback, "_use_lottery_ticket_hypothesis", True))
        if isinstance(callback, ModelPruning) and (split or (engine.layout.data_parallel_size > 1 and resets)):
            elsewhere = (
                "prune on one device and load the pruned weights (weights_from=...), or apply torch.nn.utils.prune to "
                "the model before fit and make the pruning permanent (prune.remove) so the strategy trains plain weights"
            )
            if split:
                raise ValueError(
                    f"ModelPruning is not supported with {how}: it re-parametrises weights and ranks their magnitudes "
                    f"over what one rank holds, which is not what one device prunes. Instead, {elsewhere}."
                )
            raise ValueError(
                "ModelPruning's lottery-ticket reset (use_lottery_ticket_hypothesis, on by default) is not supported under "
                "DDP replicas: it assigns the pruned weights data copied before the precision conversion (float32 under "
                "64-true), and training was measured diverging from one device after it. Pass "
                f"use_lottery_ticket_hypothesis=False, or {elsewhere}."
            )


def _check_replicas(trainer: Trainer) -> None:
    """DDP replicas: DDP averages the gradients of the parameters that require one when it wraps the module, and
    BaseFinetuning freezes in its setup (before the wrap) and unfreezes later: those gradients would stay each
    replica's own, and the replicas drift apart."""
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning):
            raise ValueError(  # noqa: TRY004 - a callback this layout cannot run: a configuration error
                f"{type(callback).__name__} unfreezes parameters during training, but DDP (data_parallel_mode="
                f"'replicate') averages only the gradients of parameters that required one when it wrapped the model: "
                f"the unfrozen ones would differ between replicas. Use data_parallel_mode='shard' (FSDP2 averages every "
                f"gradient it finds), or unfreeze before fit."
            )


def attach(engine: EngineHost, trainer: Trainer | None) -> None:
    """After setup: the finetuning callbacks compare whole values, throughput counts replicas, the LR finder reads the
    global batch's loss."""
    if trainer is None:
        return
    _ENGINES.add(engine)
    if not _LIGHTNING_FILTER:
        _LIGHTNING_FILTER.append(BaseFinetuning.__dict__["filter_on_optimizer"])
        BaseFinetuning.filter_on_optimizer = staticmethod(filter_on_optimizer)
    if not _LIGHTNING_LR_BATCH_END:
        # Lightning's private callback that the LR finder adds once fit has started (checked against Lightning 2.6).
        from lightning.pytorch.tuner.lr_finder import _LRCallback

        _LIGHTNING_LR_BATCH_END.append(_LRCallback.on_train_batch_end)
        _LRCallback.on_train_batch_end = _lr_finder_batch_end
    for callback in trainer.callbacks:
        if isinstance(callback, ThroughputMonitor):
            replicas = engine.layout.data_parallel_size
            # The callback made its meters in its setup (before this one) with world_size=trainer.world_size.
            for stage, meter in list(callback._throughputs.items()):
                if not isinstance(meter, ReplicaThroughput):
                    callback._throughputs[stage] = ReplicaThroughput(
                        replicas, trainer.world_size, available_flops=callback.available_flops, **callback.kwargs
                    )


def detach(engine: EngineHost) -> None:
    """At teardown: once no engine is set up, BaseFinetuning's own comparison again."""
    _ENGINES.discard(engine)
    if not _ENGINES and _LIGHTNING_FILTER:
        BaseFinetuning.filter_on_optimizer = _LIGHTNING_FILTER.pop()
    if not _ENGINES and _LIGHTNING_LR_BATCH_END:
        from lightning.pytorch.tuner.lr_finder import _LRCallback

        _LRCallback.on_train_batch_end = _LIGHTNING_LR_BATCH_END.pop()
