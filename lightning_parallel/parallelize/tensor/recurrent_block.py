"""Gated linear-recurrence blocks split over their channels (Griffin/RecurrentGemma's recurrent block).

Such a block reads its input through two projections ``d→w`` (a gate branch and a recurrence branch), convolves the
recurrence branch with a depthwise convolution of ``w`` channels, runs a recurrence that keeps channels (or blocks of
channels) apart, multiplies the two branches and projects back ``w→d``. Nothing between the projections mixes channels
of different blocks, so both opening projections split column-wise, the convolution over its channels (``channelwise``),
the closing projection row-wise, and the recurrence's parameters shard with their blocks: each is per channel
(``[w]``) or per block (``[h, ...]`` with ``h·b = w``, the block-diagonal gates), its block count divided. No Lightning
here.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_parallel.parallelize.tensor.channels import depthwise_channels
from lightning_parallel.parallelize.tensor.projections import QUERY_HEADS, features

#: Attributes holding one block's width on a recurrence that works block by block.
BLOCK_WIDTHS = ("head_dim", "block_width", "head_size")
#: Widths a block keeps under its own name for its channels (RecurrentGemma's ``lru_width``, which sizes its cached
#: states): divided on the block where equal to its convolution's channels.
CHANNEL_WIDTH_ATTRIBUTES = ("lru_width",)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def blockwise_children(block: nn.Module, channels: int, prefix: str = "") -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Children of ``block`` working on blocks of its ``channels``: ``{FQN: (parameter names, block-count attributes)}``.

    A child (no projection, no children of its own) keeping a block count ``h`` and a block width ``b`` with
    ``h·b = channels``, every parameter of it either ``[channels]`` (per channel) or ``[h, ...]`` (per block).
    """
    found = {}
    for child, sub in block.named_children():
        counts = {name: value for name in QUERY_HEADS if _count(value := vars(sub).get(name))}
        width = next((value for name in BLOCK_WIDTHS if _count(value := vars(sub).get(name))), None)
        params = list(sub.named_parameters(recurse=False))
        if len(set(counts.values())) != 1 or width is None or not params or any(True for _ in sub.children()):
            continue
        (heads,) = set(counts.values())
        if heads * width != channels:
            continue
        if all((p.dim() == 1 and p.shape[0] == channels) or (p.dim() >= 2 and p.shape[0] == heads) for _, p in params):
            found[f"{prefix}{child}"] = (tuple(name for name, _ in params), tuple(counts))
    return found


def match_gated_recurrence(block: nn.Module, projections: Mapping[str, nn.Module]) -> dict[str, str]:
    """Styles for a gated recurrence block's direct children, or ``{}`` (see the module docstring).

    Two projections ``d→w``, one ``w→d`` (where ``d = w`` the closing one is told by its name: ``…out``), one depthwise
    convolution of ``w`` channels, and every other child holding parameters working on blocks of those channels
    (:func:`blockwise_children`); no parameter of the block's own.
    """
    convs = {name: child for name, child in block.named_children() if depthwise_channels(child) is not None}
    if len(projections) != 3 or len(convs) != 1 or any(True for _ in block.parameters(recurse=False)):
        return {}
    (conv_name, conv), = convs.items()
    channels = depthwise_channels(conv)
    others = [child for child, sub in block.named_children()
              if child not in projections and child != conv_name and any(True for _ in sub.parameters())]
    recurrences = blockwise_children(block, channels)
    if not others or set(others) != set(recurrences):
        return {}
    widths = {name: features(m) for name, m in projections.items()}
    closing = [name for name, (width_in, _) in widths.items() if width_in == channels]
    if len(closing) > 1:
        closing = [name for name in closing if name.lower().endswith("out")]
    if len(closing) != 1:
        return {}
    d_model = widths[closing[0]][1]
    opening = [name for name in widths if name != closing[0]]
    if any(widths[name] != (d_model, channels) for name in opening):
        return {}
    return {**{name: "colwise" for name in opening}, conv_name: "channelwise", closing[0]: "rowwise"}
