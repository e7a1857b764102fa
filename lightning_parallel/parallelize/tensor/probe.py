"""An MLP split column-wise then row-wise, checked by running it: its hidden units must not meet before the down projection.

An MLP (``up``/``gate`` column-wise, ``down`` row-wise) splits exactly when everything between the projections works
unit by unit: an activation, a gate's product. Some MLPs also compute a statistic *over* the hidden units — Gemma-3n
keeps only the activations above ``mean + k·std`` of the gate's output (its "gaussian top-k" activation sparsity) —
which on a rank's slice would use that slice's mean and deviation: training would run and be wrong. Nothing in the
module tree shows it (the statistic is a few lines of the MLP's ``forward``), so :func:`check_mlp_splits` runs each
such MLP once, in one process, on a small random input and random weights (float32): whole, and as the sum of what each rank's
slices compute (``torch.func.functional_call`` with the sliced weights; a row-wise bias on one rank only). Where the
two differ, the plan is refused with the reason, and the automatic plan splits that MLP with its outputs gathered
whole instead (:mod:`~lightning_parallel.parallelize.tensor.gathered_outputs`).

MLPs of one kind (class, weight shapes and plain attributes) are run once. An MLP whose ``forward`` needs more than
the hidden states, holds buffers that are not materialised, or has more than :data:`MAX_PROBED_PARAMETERS`
parameters is not run (it splits as before). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_parallel.parallelize.tensor.plan import ResolvedPlan
from lightning_parallel.parallelize.tensor.projections import features, is_conv1d, is_projection

_OPENING = ("colwise", "fused_gate_up")
_CLOSING = ("rowwise",)
#: Largest relative difference between the whole MLP and the sum of its slices still counted as the same (float32:
#: the order of the additions differs, by about 1e-6; a statistic over a slice is off by far more).
TOLERANCE = 1e-4
#: MLPs with more parameters than this are not run (their random copy would take more than 1 GiB).
MAX_PROBED_PARAMETERS = 2**28


class HiddenUnitsMeetError(ValueError):
    """An MLP's split differs from the whole MLP: its hidden units meet before the down projection. ``plan="auto"``
    then splits it with its outputs gathered whole (:mod:`~lightning_parallel.parallelize.tensor.gathered_outputs`)."""


def check_mlp_splits(module: nn.Module, resolved: ResolvedPlan, tp_size: int) -> None:
    """Refuse a plan splitting an MLP whose hidden units are combined before its down projection.

    Raises:
        HiddenUnitsMeetError: A ValueError naming the MLP, the difference found, and the fix.
    """
    modules = dict(module.named_modules())
    seen: set[Any] = set()
    for parent, children in _mlp_regions(resolved).items():
        mlp = modules[parent]
        kind = _kind(mlp)
        if kind in seen:
            continue
        seen.add(kind)
        difference = _split_difference(mlp, {name: style for name, style in children.items()},
                                       {name: resolved.fused.get(f"{parent}.{name}") for name in children}, tp_size)
        if difference is not None and difference > TOLERANCE:
            raise HiddenUnitsMeetError(
                f"{parent} ({type(mlp).__name__}): split over {tp_size} ranks, its output differs from the whole MLP's "
                f"(relative difference {difference:.1e} on a random input): its forward combines the hidden units "
                f"before the down projection (a statistic over them, such as an activation threshold from their mean "
                f"and deviation), which a rank's slice cannot compute. Leave {parent} replicated in the plan, or give its "
                f"projections 'colwise_gather_output' (whole outputs on every rank; plan='auto' does)."
            )


def _mlp_regions(resolved: ResolvedPlan) -> dict[str, dict[str, str]]:
    """Parents whose split children are only column-wise projections then row-wise ones (an MLP), not attentions."""
    by_parent: dict[str, dict[str, str]] = {}
    for fqn, style in resolved.styles.items():
        parent, _, name = fqn.rpartition(".")
        by_parent.setdefault(parent, {})[name] = style
    attentions = set(resolved.head_attributes) | set(resolved.per_head) | set(resolved.latent)
    return {
        parent: children for parent, children in by_parent.items()
        if parent and parent not in attentions and set(children.values()) <= {*_OPENING, *_CLOSING, "replicate"}
        and any(s in _OPENING for s in children.values()) and any(s in _CLOSING for s in children.values())
    }


def _kind(mlp: nn.Module) -> Any:
    """What makes two MLPs compute alike: class, weight shapes, and plain attributes (Gemma-3n's per-layer sparsity)."""
    shapes = tuple((name, tuple(p.shape)) for name, p in mlp.named_parameters())
    attributes = tuple(sorted((k, v) for k, v in vars(mlp).items() if isinstance(v, (bool, int, float, str))))
    return type(mlp), shapes, attributes


def _split_difference(mlp: nn.Module, children: Mapping[str, str], fused: Mapping[str, Any], tp_size: int) -> float | None:
    """Relative difference between ``mlp`` whole and the sum over ranks of its slices (``None``: not run)."""
    projections = {name: mlp.get_submodule(name) for name in children}
    if not all(is_projection(p) for p in projections.values()):
        return None
    probed = random_tensors(mlp)
    if probed is None:
        return None
    weights, buffers, generator = probed
    width = next(features(projections[n])[0] for n, s in children.items() if s in _OPENING)
    hidden = torch.randn(2, 3, width, generator=generator)
    closing = [projections[name] for name, style in children.items() if style in _CLOSING]
    widths = _widths(projections, children, tp_size)

    def run(tensors: dict[str, Tensor], summed: list[Tensor], split: bool) -> tuple[Any, list[Tensor]]:
        return _run(mlp, tensors, hidden, projections, widths if split else {}, closing, summed)

    ranks = [{**weights, **_slices(weights, projections, children, fused, rank, tp_size), **buffers} for rank in range(tp_size)]
    # A chain split by registration order (inference._match_chained_mlp; its read-out "replicate") that runs whole but
    # not on the slices is called in another order: a difference, left whole.
    chained = float("inf") if "replicate" in children.values() else None
    return whole_and_split_difference(run, {**weights, **buffers}, ranks, chained)


def random_tensors(module: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor], torch.Generator] | None:
    """Random float32 weights of ``module``'s parameter shapes (scaled by their fan-in) and its buffers on the CPU, with
    the generator that drew them (for the input); ``None`` where it cannot be run so (buffers on the meta device, more
    than :data:`MAX_PROBED_PARAMETERS` parameters)."""
    if any(b.is_meta for b in module.buffers()) or sum(p.numel() for p in module.parameters()) > MAX_PROBED_PARAMETERS:
        return None
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5 for name, p in module.named_parameters()}
    buffers = {name: b.detach().to("cpu", torch.float32 if b.is_floating_point() else b.dtype) for name, b in module.named_buffers()}
    return weights, buffers, generator


def whole_and_split_difference(run: Callable[[dict[str, Tensor], list[Tensor], bool], tuple[Any, list[Tensor]]],
                               whole: dict[str, Tensor], ranks: list[dict[str, Tensor]],
                               split_failure: float | None = None) -> float | None:
    """Relative difference between a module run with ``whole`` tensors and with each rank's slices of them.

    ``run(tensors, summed, split)`` runs it and returns its output and the partial outputs of its row-wise (closing)
    calls, in call order, the first of which it replaces by ``summed``. Those are all-reduced where they are
    computed, so each call's partial outputs are summed over the ranks and the ranks run again with the sums in their
    place, until no call is left. ``None``: it could not be run on the hidden states alone (an attention's experts);
    ``split_failure`` where it ran whole but not on the slices.
    """
    try:
        with torch.no_grad():
            whole_output = _first_tensor(run(whole, [], False)[0])
    except Exception:  # noqa: BLE001 - a forward needing more than the hidden states: not run, left as planned
        return None
    try:
        with torch.no_grad():
            summed: list[Tensor] = []
            while True:
                runs = [run(tensors, summed, True) for tensors in ranks]
                if len(runs[0][1]) == len(summed) or len(summed) > 64:
                    break
                summed.append(sum(outputs[len(summed)] for _, outputs in runs))
            split = _first_tensor(runs[0][0])
    except Exception:  # noqa: BLE001
        return split_failure
    if whole_output is None or split is None or whole_output.shape != split.shape:
        return None
    return float((whole_output - split).abs().max() / whole_output.abs().max().clamp_min(1e-12))


def _first_tensor(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


def _run(mlp: nn.Module, tensors: dict[str, Tensor], hidden: Tensor, projections: Mapping[str, nn.Module],
         widths: Mapping[str, int], closing: list[nn.Module], summed: list[Tensor]) -> tuple[Any, list[Tensor]]:
    """``mlp(hidden)`` with ``tensors`` in place of its parameters and buffers (Conv1D's ``nf`` set to its slice's); the
    first calls of the ``closing`` projections return ``summed`` instead. Returns the output and every closing call's."""
    outputs: list[Tensor] = []

    def replace(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        index = len(outputs)
        outputs.append(output)
        return summed[index] if index < len(summed) else output

    hooks = [projection.register_forward_hook(replace) for projection in closing]
    saved = {name: projections[name].nf for name in widths}
    try:
        for name, width in widths.items():
            projections[name].nf = width
        return functional_call(mlp, tensors, (hidden,)), outputs
    finally:
        for hook in hooks:
            hook.remove()
        for name, value in saved.items():
            projections[name].nf = value


def _widths(projections: Mapping[str, nn.Module], children: Mapping[str, str], tp_size: int) -> dict[str, int]:
    """Output widths of a rank's column-split transformers ``Conv1D`` projections (their forward reads ``nf``)."""
    return {name: features(p)[1] // tp_size for name, p in projections.items()
            if is_conv1d(p) and children[name] in _OPENING}


def _slices(weights: Mapping[str, Tensor], projections: Mapping[str, nn.Module], children: Mapping[str, str],
            fused: Mapping[str, Any], rank: int, tp_size: int) -> dict[str, Tensor]:
    """Rank ``rank``'s slices of the split projections' weights (and biases)."""
    sliced: dict[str, Tensor] = {}
    for name, style in children.items():
        projection = projections[name]
        out_dim = 1 if is_conv1d(projection) else 0  # Conv1D stores [in, out]
        weight, bias = weights[f"{name}.weight"], weights.get(f"{name}.bias")
        if style in _OPENING:
            out = features(projection)[1]
            rows = torch.cat([torch.arange(start + rank * size // tp_size, start + (rank + 1) * size // tp_size)
                              for start, size in _blocks(fused.get(name) or (out,))])
            sliced[f"{name}.weight"] = weight.index_select(out_dim, rows)
            if bias is not None:
                sliced[f"{name}.bias"] = bias[rows]
        elif style in _CLOSING:  # "replicate": a read-out of the chain (inference._match_chained_mlp), whole
            width = features(projection)[0] // tp_size
            sliced[f"{name}.weight"] = weight.narrow(1 - out_dim, rank * width, width)
            if bias is not None and rank:
                sliced[f"{name}.bias"] = torch.zeros_like(bias)  # added once, as RowwiseParallel adds it after the sum
    return sliced


def _blocks(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes))
