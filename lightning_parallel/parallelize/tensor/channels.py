"""Depthwise convolutions inside a split region, split over their channels with the projections around them.

A short-convolution mixer (LFM2's and LFM3's ``ShortConv``) projects the model width ``d`` to a few blocks of ``w``
channels (``in_proj``: ``B | C | x``), multiplies them channel by channel, runs a *depthwise* convolution over the
sequence (``nn.Conv1d`` with ``groups = in_channels = out_channels = w``: each channel convolved alone), and
projects ``w`` channels back to ``d`` (``out_proj``). Every step between the two projections keeps channels apart,
so channels split like the heads of an attention: ``in_proj`` column-wise by blocks (style ``fused_blocks``, each
rank its part of every block), the convolution over its channels (style ``channelwise``), ``out_proj`` row-wise.

Rank ``r`` holds channels ``r·w/tp ... (r+1)·w/tp - 1`` of every block, so it needs the same channels of the
convolution: its ``weight`` (``[w, 1, kernel]``) and ``bias`` are sharded on dim 0 (``Shard(0)`` DTensors, so that
checkpoints and optimizers see the whole parameters, split) and its channel counts (``in_channels``,
``out_channels``, ``groups``) are divided by the TP degree. The mixer may call the convolution as a module or read
its ``weight`` itself (transformers' ``causal_conv1d_forward`` hands ``conv.weight`` to ``F.conv1d`` with
``groups`` taken from its input): during the *region's* forward the convolution's ``weight`` and ``bias``
attributes read this rank's local slices (as :mod:`~lightning_parallel.parallelize.tensor.per_head` does for
per-head parameters); the gradient flows back into the shard, and is whole there (a channel is computed on one rank
only): nothing is summed. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

#: Attributes of a convolution holding its channel counts, divided by the TP degree once it is split.
CHANNEL_ATTRIBUTES = ("in_channels", "out_channels", "groups")


def is_depthwise_conv(module: nn.Module) -> bool:
    """An ``nn.Conv1d/2d/3d`` (not transposed) convolving each channel alone: ``groups = in_channels = out_channels``."""
    return (
        isinstance(module, nn.modules.conv._ConvNd)
        and not module.transposed
        and module.groups == module.in_channels == module.out_channels
        and module.groups > 1
    )


def depthwise_channels(module: nn.Module) -> int | None:
    """The channel count of a depthwise convolution (see :func:`is_depthwise_conv`), else ``None``."""
    return module.groups if is_depthwise_conv(module) else None


def check_channelwise(fqn: str, module: nn.Module, tp_size: int) -> None:
    """Check that ``module`` can be split over its channels ``tp_size`` ways (style ``channelwise``).

    Raises:
        TypeError: ``module`` is not a depthwise convolution, or holds parameters other than ``weight``/``bias``.
        ValueError: Its channel count does not divide by ``tp_size``.
    """
    if not is_depthwise_conv(module):
        what = type(module).__name__
        if isinstance(module, nn.modules.conv._ConvNd):
            what += f" (groups={module.groups}, in_channels={module.in_channels}, out_channels={module.out_channels})"
        raise TypeError(
            f"{fqn}: style 'channelwise' splits a depthwise convolution (an nn.Conv1d/2d/3d with groups = in_channels "
            f"= out_channels: each channel convolved alone), got {what}. A convolution that mixes channels cannot run "
            f"on a rank's channels; leave {fqn} replicated in the plan."
        )
    others = [name for name, _ in module.named_parameters() if name not in ("weight", "bias")]
    if others:
        raise TypeError(
            f"{fqn}: style 'channelwise' splits a convolution's weight and bias, but {type(module).__name__} also holds "
            f"{', '.join(others)}. Leave {fqn} replicated in the plan."
        )
    if module.groups % tp_size:
        raise ValueError(
            f"{fqn}.groups={module.groups} (its channels) is not divisible by tensor_parallel_size={tp_size}. "
            f"Choose a tensor_parallel_size that divides {module.groups}, or leave {fqn} replicated in the plan."
        )


def split_channels(modules: Mapping[str, nn.Module], styles: Mapping[str, str], tp_mesh: Any) -> None:
    """Shard every ``channelwise`` convolution in ``styles`` over its channels, divide its channel counts, and make
    its parent's forward (the region that calls it or reads its weight) see this rank's slices."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp_size = tp_mesh.size()
    by_parent: dict[str, list[nn.Module]] = {}
    for fqn, style in styles.items():
        if style != "channelwise":
            continue
        conv = modules[fqn]
        names = []
        for name, param in list(conv.named_parameters(recurse=False)):
            placed = distribute_tensor(param.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
            conv.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
            names.append(name)
        for attr in CHANNEL_ATTRIBUTES:
            setattr(conv, attr, getattr(conv, attr) // tp_size)
        by_parent.setdefault(fqn.rpartition(".")[0], []).append(conv)
    for parent, convs in by_parent.items():
        view = _LocalChannels(convs)
        modules[parent].register_forward_pre_hook(view.enter)
        modules[parent].register_forward_hook(view.leave, always_call=True)


class _LocalChannels:
    """Puts ``to_local()`` of each convolution's sharded parameters in its ``__dict__`` while the region runs.

    Attribute lookup finds the instance ``__dict__`` before ``nn.Module.__getattr__`` looks in ``_parameters``, so
    ``conv.weight`` reads the local slice inside the region (whether the region calls ``conv`` or reads its weight),
    while ``named_parameters`` and ``state_dict`` keep the sharded parameter.
    """

    def __init__(self, convs: list[nn.Module]) -> None:
        self.convs = convs

    def enter(self, *_: Any) -> None:
        for conv in self.convs:
            for name, param in conv._parameters.items():
                if param is not None and hasattr(param, "to_local"):
                    conv.__dict__[name] = param.to_local()

    def leave(self, *_: Any) -> None:
        for conv in self.convs:
            for name in list(conv._parameters):
                conv.__dict__.pop(name, None)
