"""Side paths of projections added to a split projection's output (Zamba2's per-depth LoRA adapters), split with it.

Zamba2's shared block adds, at each depth, an adapter ``Sequential(d→r, r→W)`` of the block's input to the output of
its gate|up (and q/k/v) projection: ``gate_up_proj(x) + adapter(x)``. With that projection split column-wise, a rank
holds a slice of its ``W`` features; an adapter left whole would add all ``W`` to that slice. Instead the adapter's
last projection is split exactly as the projection it writes beside (same style, same blocks: a fused gate|up's rows
reordered rank-major alike), so each rank adds its own features of both; the projections before it stay replicated
(the last one's column split sums its input gradient over the ranks, so theirs is whole on every rank).

Recognised by structure, in a module holding a split region (column-wise projections and the row-wise one closing
them): a container below it (not one of its projections) whose only parameters are projections, chained in
registration order (each reading the width the previous writes), the first reading the width the region's
column-wise projections read, the last writing exactly the width of one of them (not the region's input width: an
output of that width could be added to anything), none already split by a rule of its own. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_parallel.parallelize.tensor.projections import features, is_projection
from lightning_parallel.parallelize.tensor.split_region import regions_of

#: Styles of a region's opening projection that an adapter's last projection can copy (a plain column split, or
#: blocks computed from its own width alone). Per-head layouts (fused q|k|v, grouped k/v) are not followed.
_FOLLOWED = ("colwise", "fused_gate_up")


def fold_side_paths(module: nn.Module, units: list[dict[str, str]]) -> list[dict[str, str]]:
    """``units`` with every region's adapters (see the module docstring) added to that region's unit; a unit an
    adapter's projections formed on their own (a two-layer projector) is dropped for it. Returns a new list."""
    modules = dict(module.named_modules())
    folded: dict[int, dict[str, str]] = {}
    claimed: set[str] = set()
    for index, unit in enumerate(units):
        for region, (opening, _) in regions_of(unit).items():
            for container, styles in _adapters(modules, region, {c: unit[f"{region}.{c}"] for c in opening}).items():
                if not any(_within(fqn, claimed) for fqn in styles):
                    folded.setdefault(index, {}).update(styles)
                    claimed.add(container)
    if not folded:
        return units
    result = []
    for index, unit in enumerate(units):
        if index in folded:
            result.append({**unit, **folded[index]})
        elif not any(_within(fqn, claimed) for fqn in unit):
            result.append(unit)
    return result


def _adapters(modules: Mapping[str, nn.Module], region: str, opening: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """``{container FQN: {projection FQN: style}}`` for the adapters below ``region``."""
    inputs = {features(modules[f"{region}.{child}"])[0] for child in opening}
    widths: dict[int, str] = {}
    for child, style in opening.items():
        width = features(modules[f"{region}.{child}"])[1]
        if style in _FOLLOWED and width not in inputs:
            widths.setdefault(width, style)
    if len(inputs) != 1 or not widths:
        return {}
    found: dict[str, dict[str, str]] = {}
    for fqn, sub in modules[region].named_modules(prefix=region):
        if fqn == region or is_projection(sub) or any(fqn.startswith(f"{done}.") for done in found):
            continue
        chain = _chain(sub)
        if chain is None:
            continue
        first, last = features(chain[0][1]), features(chain[-1][1])
        if first[0] in inputs and last[1] in widths:
            found[fqn] = {**{f"{fqn}.{name}": "replicate" for name, _ in chain[:-1]}, f"{fqn}.{chain[-1][0]}": widths[last[1]]}
    return found


def _chain(container: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """``container``'s projections in registration order if they are its only parameters, two or more, and chained."""
    projections = [(name, sub) for name, sub in container.named_children() if is_projection(sub)]
    held = sum(p.numel() for p in container.parameters())
    if len(projections) < 2 or held != sum(p.numel() for _, sub in projections for p in sub.parameters()):
        return None
    if any(features(a)[1] != features(b)[0] for (_, a), (_, b) in zip(projections, projections[1:])):
        return None
    return projections


def _within(fqn: str, names: set[str]) -> bool:
    return any(fqn == name or fqn.startswith(f"{name}.") for name in names)
