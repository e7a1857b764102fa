"""Recurrences over channels (RWKV's time-mix block): projections split, outputs gathered whole.

Such a block projects its input ``d→c`` (key, value, receptance), runs a recurrence along the sequence that keeps
each of the ``c`` channels apart, with per-channel parameters of its own (``time_decay``, ``time_first``: ``[c]``),
and projects ``c→d``. Its own other parameters are vectors mixing its input (``time_mix_*``: ``[1, 1, d]``). The
channels could split like an attention's heads, but the recurrence's state is the model's: allocated outside the
block at the whole width and written by the block in evaluation (RWKV's ``state`` list). So the block's projections
are split over their output features with their outputs gathered whole (``colwise_gather_output``,
:mod:`~lightning_parallel.parallelize.tensor.gathered_outputs`): the weights are divided, the recurrence runs on whole
channels on every rank, exactly as on one device. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_parallel.parallelize.tensor.gathered_outputs import STYLE
from lightning_parallel.parallelize.tensor.projections import KEY_VALUE_HEADS, QUERY_HEADS, features, head_count


def match_channel_recurrence(block: nn.Module, projections: Mapping[str, nn.Module]) -> dict[str, str]:
    """Styles for a channel recurrence's projections, or ``{}``.

    Recognised by structure: no head count (an attention's heads are split by the attention rules), no child holding
    parameters besides its projections, two or more projections, each ``d→c`` or ``c→d`` with at least one each way
    (with ``d = c`` every projection is both), and parameters of its own that are all vectors (one value per feature,
    however shaped), at least one of them ``[c]`` (the per-channel decays).
    """
    if len(projections) < 2 or head_count(block, QUERY_HEADS) is not None or head_count(block, KEY_VALUE_HEADS) is not None:
        return {}
    if any(child not in projections and any(True for _ in sub.parameters()) for child, sub in block.named_children()):
        return {}
    own = [param for _, param in block.named_parameters(recurse=False)]
    if not own or any(param.dim() == 0 or param.numel() != max(param.shape) for param in own):
        return {}
    channels = {param.shape[0] for param in own if param.dim() == 1}
    widths = list(features(projection) for projection in projections.values())
    inputs = {width_in for width_in, _ in widths}
    if len(channels) != 1 or len(inputs) > 2:
        return {}
    (c,) = channels
    opening = [(i, o) for i, o in widths if o == c]
    closing = [(i, o) for i, o in widths if i == c]
    if not opening or not closing or any(o != c and i != c for i, o in widths):
        return {}
    d = {i for i, o in opening} | {o for i, o in closing}
    if len(d) != 1 or any(param.shape[-1] not in (c, *d) for param in own):
        return {}
    return {name: STYLE for name in projections}


def sequence_mixing_block(module: nn.Module, unit: Mapping[str, str]) -> str | None:
    """The block holding ``unit`` where it is a channel recurrence or an MLP beside square projections (RWKV's two
    blocks, which mix each token with the previous one before their projections), else ``None``. Under sequence
    parallelism such a block stays whole: on a rank's part of the sequence it would read the wrong previous token."""
    from lightning_parallel.parallelize.tensor.mlp_beside import match_mlp_beside_squares
    from lightning_parallel.parallelize.tensor.projections import is_projection

    parents = {fqn.rpartition(".")[0] for fqn in unit}
    if len(parents) != 1:
        return None
    (parent,) = parents
    block = module.get_submodule(parent)
    projections = {name: sub for name, sub in block.named_children() if is_projection(sub)}
    if not {fqn.rpartition(".")[2] for fqn in unit} <= set(projections):
        return None
    found = match_channel_recurrence(block, projections) or match_mlp_beside_squares(block, projections)
    return parent if found and {f"{parent}.{name}" if parent else name for name in found} == set(unit) else None
