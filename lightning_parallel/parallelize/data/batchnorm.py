"""Batch statistics over the whole data-parallel batch, on GPU and CPU.

Under data parallelism each rank's BatchNorm sees only its own slice of the global batch, so its mean
and variance differ from single-device training with the full batch. Synchronized BatchNorm all-reduces
the statistics over the data-parallel group. On accelerators we use torch's ``nn.SyncBatchNorm``; torch
has no CPU implementation (and DDP refuses ``nn.SyncBatchNorm`` on CPU), so :class:`CPUSyncBatchNorm`
provides one, built on differentiable all-reduces.

A pipeline cannot keep batch statistics whole: it runs each batch as micro-batches.
:func:`check_pipeline_batch_statistics` refuses the pipeline steps whose BatchNorm statistics would differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_parallel import collectives


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are computed over every rank of ``process_group`` (CPU/gloo).

    The forward pass all-reduces the per-channel sums to get the global mean, then the sums of squared
    deviations to get the global (biased) variance — two collectives, numerically stable — normalizes,
    and updates the running statistics exactly as ``nn.BatchNorm`` would on the concatenated batch. The
    backward pass all-reduces the statistics' gradients, as torch's CUDA kernels do.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D input")

    def forward(self, input: Tensor) -> Tensor:
        if not self._synchronizes():
            return super().forward(input)
        self._check_input_dim(input)
        group = self.process_group or dist.group.WORLD
        reduce_dims = [0, *range(2, input.dim())]
        shape = [1, input.size(1)] + [1] * (input.dim() - 2)

        local_count = input.numel() // input.size(1)
        sums = torch.cat([input.sum(reduce_dims), input.new_tensor([local_count])])
        sums = collectives.differentiable_all_reduce(sums, group)
        count = sums[-1].detach()
        mean = sums[:-1] / count
        centered = input - mean.view(shape)
        var = collectives.differentiable_all_reduce((centered * centered).sum(reduce_dims), group) / count

        output = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count)
        return output

    def _synchronizes(self) -> bool:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group or dist.group.WORLD) > 1

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, biased_var: Tensor, count: Tensor) -> None:
        self.num_batches_tracked.add_(1)
        # Same momentum rule as nn.BatchNorm: `momentum=None` means a cumulative moving average.
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased_var = biased_var * (count / (count - 1)) if count > 1 else biased_var
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


_SYNC_CLASSES = (nn.SyncBatchNorm, CPUSyncBatchNorm)


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None, device_type: str) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by a synchronized one over ``process_group``.

    ``nn.SyncBatchNorm`` on accelerators, :class:`CPUSyncBatchNorm` on CPU. Parameters and running
    statistics are carried over (the same tensors, not copies); :func:`revert_sync_batchnorm` restores the
    original layer classes.
    """
    sync_class = CPUSyncBatchNorm if device_type == "cpu" else nn.SyncBatchNorm
    if isinstance(module, _BatchNorm) and not isinstance(module, _SYNC_CLASSES):
        synced = sync_class(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, process_group
        )
        _carry_state(module, synced)
        synced.reverts_to = type(module)
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group, device_type))
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: each synchronized layer becomes its original class again."""
    original_class = getattr(module, "reverts_to", None)
    if isinstance(module, _SYNC_CLASSES) and original_class is not None:
        original = original_class(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        _carry_state(module, original)
        return original
    for name, child in module.named_children():
        module.add_module(name, revert_sync_batchnorm(child))
    return module


def _carry_state(source: _BatchNorm, target: _BatchNorm) -> None:
    if source.affine:
        target.weight, target.bias = source.weight, source.bias
    target.running_mean, target.running_var = source.running_mean, source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


def batch_statistics_layers(module: nn.Module, training: bool) -> list[str]:
    """Names of the BatchNorm layers in ``module`` that normalise by the statistics of the batch they see.

    In training every BatchNorm does; in evaluation only those without running statistics
    (``track_running_stats=False``), as ``nn.BatchNorm``'s own rule says.
    """
    return [
        name
        for name, layer in module.named_modules()
        if isinstance(layer, _BatchNorm) and (training or layer.running_mean is None or layer.running_var is None)
    ]


def unsynchronized_batchnorm_warning(layers: list[str], module_name: str, replicas: int) -> str | None:
    """The warning for BatchNorm layers that data parallelism leaves per replica, or ``None`` without any.

    Without ``sync_batchnorm`` each of the ``replicas`` normalises by the statistics of its own slice of the
    global batch (as Lightning's DDP does): training differs from one device running the whole batch.

    Args:
        layers: What :func:`batch_statistics_layers` found for training.
        module_name: The module's class name, for the message.
        replicas: Data-parallel replicas.
    """
    if not layers or replicas <= 1:
        return None
    named = _first_names(layers)
    return (
        f"{module_name} has {len(layers)} BatchNorm layers ({named}) and sync_batchnorm is off: each of the "
        f"{replicas} data-parallel replicas normalises by the statistics of its own slice of the batch, not the "
        f"global batch's as one device would. Pass sync_batchnorm=True to the strategy (on the command line: "
        f"trainer.sync_batchnorm=true) for statistics over the global batch."
    )


def check_pipeline_batch_statistics(
    layers: list[str], module_name: str, microbatches: int, rows: int | None = None, padded_rows: int | None = None
) -> None:
    """Refuse a pipeline step whose BatchNorm statistics would differ from those of the whole batch.

    A pipeline runs each batch as ``microbatches`` micro-batches, and pads an epoch's smaller last batch to
    the traced shape: a BatchNorm layer using batch statistics would normalise by each micro-batch's
    statistics (or count the padding rows) — training that silently differs from one device. Every rank
    sees the same batch sizes, so every rank raises here, before any communication of the step.

    Args:
        layers: What :func:`batch_statistics_layers` found in the module the pipeline cuts, for the step's
            mode (found before the cut: afterwards each rank holds only its stages' running statistics).
        module_name: That module's class name, for the message.
        microbatches: Micro-batches per batch.
        rows: Rows of this batch, and ``padded_rows`` what the pipeline would pad it to (both or neither).

    Raises:
        ValueError: There are such layers and ``microbatches > 1`` or the batch would be padded.
    """
    if not layers:
        return
    named = _first_names(layers)
    what = f"{module_name} has BatchNorm layers ({named}) that normalise by the statistics of the batch they see"
    if microbatches > 1:
        raise ValueError(
            f"{what}, and the pipeline splits each batch into microbatches={microbatches} micro-batches: each would be "
            f"normalised by its own statistics, not the whole batch's as on one device. Use microbatches=1 (with "
            f"schedule='gpipe'; exact, but the stages do not overlap), replace BatchNorm by GroupNorm or LayerNorm, "
            f"or use data parallelism (DataParallelStrategy(sync_batchnorm=True) for statistics over the global batch)."
        )
    if rows is not None and padded_rows is not None and rows < padded_rows:
        raise ValueError(
            f"{what}, and this batch of {rows} rows would be padded to the traced {padded_rows} rows, padding that "
            f"the statistics would include. Keep every batch the same size (DataLoader(drop_last=True) for training)."
        )


def replica_divergent_buffers(module: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Names of the buffers of ``module`` (outside BatchNorm layers, judged on their own) whose values differ
    between the data-parallel replicas of ``group``: statistics of the slice of the batch each replica saw.

    Compared by a checksum per buffer (sum and sum of squares in float64), gathered once over ``group``; buffers a
    step rebuilds the same way on every replica (rotary caches, masks) are equal and not named. Every rank of
    ``group`` must call this with the same buffers (replicas of one model, or of one pipeline stage).
    """
    batchnorm_prefixes = tuple(f"{name}." for name, layer in module.named_modules() if isinstance(layer, _BatchNorm))
    named = [
        (name, buffer)
        for name, buffer in module.named_buffers()
        if buffer is not None and not buffer.is_meta and buffer.numel() > 0
        and not (batchnorm_prefixes and name.startswith(batchnorm_prefixes))
    ]
    if not named:
        return []
    # One tensor on the backend's device (gloo: the host), whatever device each buffer is on.
    device = collectives.group_device(group)
    sums = torch.stack([torch.stack([b.detach().double().sum(), b.detach().double().square().sum()]).to(device) for _, b in named])
    stacked = torch.stack(collectives.all_gather(sums, group))  # [replicas, buffers, 2]
    differs = ~(stacked == stacked[:1]).all(dim=(0, 2))
    return [name for (name, _), different in zip(named, differs.tolist()) if different]


def running_statistics_warning(divergent: list[str], module_name: str, replicas: int) -> str | None:
    """The warning for buffers a training step updates from the batch it sees (like BatchNorm's running statistics,
    but of any layer: I-BERT's activation ranges, a running mean kept by hand), or ``None`` without any.

    Each data-parallel replica updates them from its own slice of the global batch, so the saved values differ from
    one device's (the parameters and the loss need not: these buffers may not feed the forward at all).

    Args:
        divergent: What :func:`replica_divergent_buffers` found after one of the first training steps (not named before).
        module_name: The module's class name, for the message.
        replicas: Data-parallel replicas, times context-parallel peers.
    """
    if not divergent or replicas <= 1:
        return None
    named = _first_names(divergent)
    return (
        f"{module_name} has {len(divergent)} buffers ({named}) that differ between data-parallel replicas (or "
        f"context-parallel peers) after a training step: running statistics of the batch each one sees. Each of the "
        f"{replicas} replicas updates them from its own slice of the global batch (or part of each sequence) "
        f"(replicas start every step from rank 0's under DDP), so they differ from one device training on the whole "
        f"batch, and so do the values saved in checkpoints. Where they feed the forward (quantization ranges, "
        f"normalisation), training differs too; keep data_parallel_size=1 (and context_parallel_size=1) for such a model, or freeze the statistics."
    )


def _first_names(names: list[str]) -> str:
    """The first three names, and how many more (for a message)."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
