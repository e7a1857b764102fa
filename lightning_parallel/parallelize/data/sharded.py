"""Sharded data parallelism: FSDP2 ``fully_shard`` on the data-parallel part of the DeviceMesh.

Used for ``data_parallel_mode="shard"`` (a 1-D mesh: ZeRO-3), ``"hybrid_shard"`` (a 2-D
``(replicate, shard)`` mesh: HSDP), and for replicas of tensor-parallel modules, whose DTensor parameters
DDP cannot take (``"replicate"`` there is HSDP with shards of one rank: all-reduce, no sharding). No
Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2's default collectives, which FSDPModule.set_custom_all_gather / set_custom_reduce_scatter accept subclasses
# of (private in torch 2.13, checked: FSDP2 keeps its fast paths for subclasses of the defaults).
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from lightning_parallel.measure.comm import CommStats


def shard_over_data_parallel(
    root: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> list[nn.Module]:
    """Apply ``fully_shard`` to the parameter-holding children of ``root``; returns the sharded units.

    ``dp_mesh`` is 1-D (shard over it) or 2-D ``(replicate, shard)`` (HSDP). ``ignored_params`` stay as they
    are, neither sharded nor reduced (experts that expert parallelism divides and reduces itself).

    ``root`` itself is not sharded: its entry points (e.g. a LightningModule's ``training_step``) are not
    its ``forward``, so FSDP's hooks would never run on it. Instead each direct child that owns
    parameters becomes a unit, and each element of an ``nn.ModuleList`` inside it (the transformer blocks)
    becomes its own unit first, so only one block's parameters are gathered at a time.

    Raises:
        ValueError: If ``root`` holds parameters directly (they would never be synchronized).
    """
    direct = [name for name, _ in root.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"{type(root).__name__} holds parameters directly ({', '.join(direct)}); with data parallelism over "
            f"split (DTensor) parameters they must live in a submodule. Move them into an nn.Module attribute."
        )
    options = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy or MixedPrecisionPolicy(),
               "ignored_params": ignored_params or None}
    units: list[nn.Module] = []
    for child in root.children():
        if not any(True for _ in child.parameters()):
            continue
        for block_list in _module_lists(child):
            for block in block_list:
                if any(True for _ in block.parameters()):
                    fully_shard(block, **options)
                    units.append(block)
        if isinstance(child, nn.ModuleList):
            continue  # a LightningModule's own list of blocks: no forward of its own, each block is a unit already
        fully_shard(child, **options)
        units.append(child)
    return units


def count_communication(units: list[nn.Module], stats: CommStats) -> None:
    """Count every all-gather (the gathered parameters) and reduce-scatter (the whole gradients) of the FSDP2
    ``units`` in ``stats``, through FSDP2's own hooks for custom collectives: the default collectives, counted."""
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(_CountedAllGather(stats))
            unit.set_custom_reduce_scatter(_CountedReduceScatter(stats))


class _CountedAllGather(DefaultAllGather):
    def __init__(self, stats: CommStats) -> None:
        super().__init__()
        self.stats = stats

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
        if dist.get_world_size(group) > 1:  # shards of one rank (HSDP's replicas of tensor-parallel modules) gather nothing
            self.stats.record_transfer(output_tensor.numel() * output_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountedReduceScatter(DefaultReduceScatter):
    def __init__(self, stats: CommStats) -> None:
        super().__init__()
        self.stats = stats

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        if dist.get_world_size(group) > 1:
            self.stats.record_transfer(input_tensor.numel() * input_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def set_gradient_sync(units: list[nn.Module], enabled: bool) -> None:
    """Switch the reduce-scatter of gradients on or off (off while accumulating micro-batches)."""
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.set_requires_gradient_sync(enabled, recurse=False)


def _module_lists(module: nn.Module) -> Iterator[nn.ModuleList]:
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList):
            yield sub
