"""A two-layer projector ``a→h, h→e`` (a multimodal model's adaptor into the language model), split as an MLP.

A module holding exactly two projections, the second reading the width the first writes (``a→h``, ``h→e``), with
``e ≠ a`` (``e = a`` is an MLP, :func:`~lightning_parallel.parallelize.tensor.inference._match_mlp`), computes
``second(act(first(x)))`` in every multimodal projector transformers has (MOSS's audio adaptor ``linear_1``/``linear_2``
then a norm of the output width). Then the first splits column-wise, the second row-wise (its output, summed over the
ranks, is whole): exact whatever the widths. Shapes alone do not show that the module calls them in that order, one
after the other, with nothing but elementwise functions between (two heads reading one input have the same shapes
when ``a = h``), so the split is only proposed after running the module once, whole and as the sum of each rank's
slices (:mod:`~lightning_parallel.parallelize.tensor.probe`, random float32 weights on the CPU): a module that cannot
be run on one input tensor, runs differently or returns another shape stays whole. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

# The probe's own runner and its notion of one kind of module (private to the package, shared with the MLP check).
from lightning_parallel.parallelize.tensor.probe import TOLERANCE, _kind, _split_difference
from lightning_parallel.parallelize.tensor.projections import features

#: Results of :func:`match_projector` by module kind (class, parameter shapes, plain attributes): the probe runs once
#: per kind (a model holds one projector, or one per modality; layers of a stack share one kind).
_CHECKED: dict[Any, bool] = {}


def match_projector(sub: nn.Module, projections: Mapping[str, nn.Module]) -> dict[str, str]:
    """``{first: "colwise", second: "rowwise"}`` for a two-layer projector (see the module docstring), else ``{}``.

    Besides its two projections, ``sub`` may hold only vectors (norms, biases of other children); no parameter of its
    own and no child holding projections of its own.
    """
    if len(projections) != 2 or any(True for _ in sub.parameters(recurse=False)):
        return {}
    (first, a), (second, b) = projections.items()
    (a_in, hidden), (b_in, b_out) = features(a), features(b)
    if hidden != b_in or a_in == b_out:
        return {}
    for child, module in sub.named_children():
        if child in projections:
            continue
        if any(param.dim() != 1 for param in module.parameters()):
            return {}
    divisor = next((d for d in range(2, hidden + 1) if hidden % d == 0), None)
    if divisor is None:
        return {}
    styles = {first: "colwise", second: "rowwise"}
    kind = _kind(sub)
    if kind not in _CHECKED:
        if len(_CHECKED) > 256:
            _CHECKED.clear()
        difference = _split_difference(sub, styles, {}, divisor)
        _CHECKED[kind] = difference is not None and difference <= TOLERANCE
    return styles if _CHECKED[kind] else {}

