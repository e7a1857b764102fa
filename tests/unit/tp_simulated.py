"""Run a module split by the auto tensor-parallel plan over 2 simulated ranks, and whole, for exactness tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, apply_tensor_parallel, check_plan


def _backward_of_a_weighted_sum(out: torch.Tensor) -> None:
    """A loss that weighs each output feature differently, so a wrong column is seen in every gradient."""
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()


def split_and_run(
    module: nn.Module, simulated_ranks, x: torch.Tensor, reduce_regions: bool = False, **resolve: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """``module`` split over 2 simulated tp ranks by the auto plan: (output, whole gradient of each parameter, the
    resolved plan). ``reduce_regions``: sum the replicated gradients of split regions over the ranks first, as the
    strategy does after backward; ``resolve``: keyword arguments of ``TensorParallelConfig.resolve``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallelize.tensor.split_region import reduce_split_region_gradients

    resolved = TensorParallelConfig().resolve(module, tp_size=2, **resolve)
    check_plan(module, resolved, 2)
    with simulated_ranks():
        apply_tensor_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved)
        out = module(x)
        _backward_of_a_weighted_sum(out)
        if reduce_regions:
            reduce_split_region_gradients(module)
        whole = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t)._local_tensors[0]  # noqa: E731
        return whole(out).detach(), {n: whole(p.grad) for n, p in module.named_parameters() if p.grad is not None}, resolved


def whole_run(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``module`` run whole: (output, gradient of each parameter) under the same loss as :func:`split_and_run`."""
    out = module(x)
    _backward_of_a_weighted_sum(out)
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
