"""Sharded data parallelism: FSDP2 ``fully_shard`` on the data-parallel part of the DeviceMesh.

Used for ``data_parallel_mode="shard"`` (a 1-D mesh: ZeRO-3), ``"hybrid_shard"`` (a 2-D
``(replicate, shard)`` mesh: HSDP), and for replicas of tensor-parallel modules, whose DTensor parameters
DDP cannot take (``"replicate"`` there is HSDP with shards of one rank: all-reduce, no sharding). No
Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


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


def set_gradient_sync(units: list[nn.Module], enabled: bool) -> None:
    """Switch the reduce-scatter of gradients on or off (off while accumulating micro-batches)."""
    for unit in units:
        if isinstance(unit, FSDPModule):
            unit.set_requires_gradient_sync(enabled, recurse=False)


def _module_lists(module: nn.Module) -> Iterator[nn.ModuleList]:
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList):
            yield sub
