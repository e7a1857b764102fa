"""Batch statistics over the whole data-parallel batch, on GPU and CPU.

Under data parallelism each rank's BatchNorm sees only its own slice of the global batch, so its mean
and variance differ from single-device training with the full batch. ``SyncBatchNorm`` all-reduces the
statistics over the data-parallel group. torch's ``nn.SyncBatchNorm`` runs on accelerators only; this
subclass keeps torch's kernels there and adds a CPU (gloo) path built on differentiable all-reduces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor, nn


class SyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` that also synchronizes batch statistics for CPU tensors.

    On CPU the forward pass computes the global per-channel mean, then the global variance of the
    centered input (two all-reduces, numerically stable), normalizes, and updates the running statistics
    exactly as ``nn.BatchNorm`` would on the concatenated batch. The backward pass all-reduces the
    statistics' gradients, which is what torch's CUDA kernels do too.
    """

    def forward(self, input: Tensor) -> Tensor:
        if input.device.type != "cpu" or not self._synchronizes():
            return super().forward(input)
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        return self._cpu_synchronized_forward(input)

    def _synchronizes(self) -> bool:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group or dist.group.WORLD) > 1

    def _cpu_synchronized_forward(self, input: Tensor) -> Tensor:
        group = self.process_group or dist.group.WORLD
        reduce_dims = [0, *range(2, input.dim())]
        shape = [1, input.size(1)] + [1] * (input.dim() - 2)

        local_count = input.numel() // input.size(1)
        sums = torch.cat([input.sum(reduce_dims), input.new_tensor([local_count])])
        sums = dist_fn.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        count = sums[-1].detach()
        mean = sums[:-1] / count
        centered = input - mean.view(shape)
        var = dist_fn.all_reduce((centered * centered).sum(reduce_dims), op=dist.ReduceOp.SUM, group=group) / count

        output = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count)
        return output

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, biased_var: Tensor, count: Tensor) -> None:
        self.num_batches_tracked.add_(1)
        # Same momentum rule as nn.BatchNorm: `momentum=None` means a cumulative moving average.
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased_var = biased_var * (count / (count - 1)) if count > 1 else biased_var
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by :class:`SyncBatchNorm` over ``process_group``.

    Parameters and running statistics are carried over (shared, not copied). Returns the converted module,
    which is a new object if ``module`` itself was a BatchNorm layer.
    """
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for layer in converted.modules():
        if type(layer) is nn.SyncBatchNorm:
            # torch's converter always builds its own class; ours adds no state, only the CPU code path.
            layer.__class__ = SyncBatchNorm
    return converted
