"""An MLP beside square projections of the model width (RWKV's channel-mix block: ``key``/``value`` and a
``receptance`` gate): the MLP splits, the square projections stay whole.

A module holding one projection ``d→h`` (``h > d``), one ``h→d``, and projections ``d→d`` holds an MLP whose hidden
units nothing else can read (nothing else is ``h`` wide): the square projections work on whole values of the model
width, before the MLP (its input) or after it (a gate on its all-reduced output, as RWKV's ``receptance · value``).
The pair splits column- then row-wise, the square ones are named ``replicate``; the split is checked by running the
module (:func:`~lightning_parallel.parallelize.tensor.probe.check_mlp_splits`): where a square projection's output
meets the hidden units after all, the difference leaves it whole, named. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_parallel.parallelize.tensor.projections import KEY_VALUE_HEADS, QUERY_HEADS, features, head_count


def match_mlp_beside_squares(block: nn.Module, projections: Mapping[str, nn.Module]) -> dict[str, str]:
    """``{up: colwise, down: rowwise, square: replicate, ...}`` for such a module (no head count: not an attention),
    or ``{}``."""
    if head_count(block, QUERY_HEADS) is not None or head_count(block, KEY_VALUE_HEADS) is not None:
        return {}
    widths = {name: features(projection) for name, projection in projections.items()}
    squares = [name for name, (width_in, out) in widths.items() if width_in == out]
    pair = [name for name in widths if name not in squares]
    if not squares or len(pair) != 2 or len({widths[name][0] for name in squares}) != 1:
        return {}
    d = widths[squares[0]][0]
    up = [name for name in pair if widths[name][0] == d and widths[name][1] > d]
    down = [name for name in pair if widths[name][1] == d and widths[name][0] > d]
    if len(up) != 1 or len(down) != 1 or widths[up[0]][1] != widths[down[0]][0]:
        return {}
    return {**{name: "replicate" for name in squares}, up[0]: "colwise", down[0]: "rowwise"}
