"""Micro-batches of a step: cutting a batch by rows, padding to the traced shape, combining results and logs.

No torch.distributed here: :class:`~lightning_parallel.strategies.components.pipeline.runner.PipelineRunner` uses these
to turn one Lightning step into micro-batch calls of the user's step and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map
from torchmetrics import Metric

#: One ``self.log`` call: name, value, keyword options.
LogCall = tuple[str, Any, dict[str, Any]]

#: Log reductions (``self.log(reduce_fx=...)``) and how micro-batch values combine under each.
_SUMMED = {"sum", torch.sum}
_MAXED = {"max", torch.max}
_MINNED = {"min", torch.min}


def loss_of(result: Any, hook: str) -> Tensor:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"{hook} returned {type(result).__name__} for a micro-batch; under pipeline parallelism it must return the "
            f"loss tensor (or a dict with a 'loss' tensor) for every batch — skipping a batch by returning None is not supported."
        )
    return loss


def combine(values: list[Any], weights: list[int]) -> Any:
    """Micro-batch results as one batch's: scalars averaged by rows, batched tensors concatenated."""
    present = [(v, w) for v, w in zip(values, weights) if v is not None and w > 0]
    if not present:
        return None
    first = present[0][0]
    if isinstance(first, Tensor):
        if first.ndim == 0:
            total = sum(w for _, w in present)
            return sum(v.to(torch.float64) * w for v, w in present).div(total).to(first.dtype)
        return torch.cat([v for v, _ in present])
    if isinstance(first, Mapping):
        return {k: combine([v.get(k) if v is not None else None for v in values], weights) for k in first}
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        combined = [combine([v[i] if v is not None else None for v in values], weights) for i in range(len(first))]
        return type(first)(combined) if isinstance(first, list) else tuple(combined)
    return present[-1][0]


def combine_logs(logs: dict[int, list[LogCall]], rows: list[int], module: nn.Module) -> list[LogCall]:
    """One ``self.log`` call per name from the calls each micro-batch made, values combined by the log's
    ``reduce_fx`` (row-weighted mean by default). Metric objects become ``("__metric__", name)``."""
    order: list[str] = []
    by_name: dict[str, list[tuple[int, Any, dict[str, Any]]]] = {}
    for index in sorted(logs):
        for name, value, options in logs[index]:
            if name not in by_name:
                order.append(name)
            by_name.setdefault(name, []).append((index, value, options))
    metric_names = {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}
    combined = []
    for name in order:
        entries = by_name[name]
        value, options = entries[-1][1], entries[-1][2]
        if isinstance(value, Metric):
            # Metric objects are not sent: every rank logs its own copy, whose state syncs at compute().
            combined.append((name, ("__metric__", metric_names[id(value)]), options))
            continue
        reduce_fx = options.get("reduce_fx", "mean")
        values = [torch.as_tensor(v).detach() for _, v, _ in entries]
        if reduce_fx in _SUMMED:
            result = torch.stack(values).sum(0)
        elif reduce_fx in _MAXED:
            result = torch.stack(values).amax(0)
        elif reduce_fx in _MINNED:
            result = torch.stack(values).amin(0)
        else:
            result = combine(values, [rows[i] for i, _, _ in entries])
        combined.append((name, result, options))
    return combined


def split_rows(batch: Any, total: int, rows: list[int]) -> list[Any]:
    """The batch cut into micro-batches of ``rows`` (tensors whose first dimension is the batch's)."""
    leaves, spec = tree_flatten(batch)
    split_leaves = [
        torch.split(leaf, rows) if isinstance(leaf, Tensor) and leaf.ndim and leaf.shape[0] == total else None for leaf in leaves
    ]
    return [
        spec.unflatten([parts[j] if parts is not None else leaf for leaf, parts in zip(leaves, split_leaves)])
        for j in range(len(rows))
    ]


def tensor_leaves(tree: Any) -> list[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


def batch_rows(args: Any, kwargs: Any = None) -> int:
    tensors = [t for t in tensor_leaves((args, kwargs)) if t.ndim > 0]
    if not tensors:
        raise TypeError("The model is called without a batched tensor input; pipeline parallelism splits tensor inputs along dim 0.")
    return tensors[0].shape[0]


def first_rows(tree: Any, total: int, rows: int) -> Any:
    return tree_map(lambda t: t[:rows] if isinstance(t, Tensor) and t.ndim and t.shape[0] == total else t, tree)


def pad_rows(t: Any, total: int, target: int) -> Any:
    if not isinstance(t, Tensor) or not t.ndim or t.shape[0] != total:
        return t
    # Repeat the last row: valid input (e.g. token ids) whose outputs are dropped before the user's step.
    return torch.cat([t, t[-1:].expand(target - total, *t.shape[1:])])


def zero_like_output(output: Any) -> Tensor:
    floats = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.is_floating_point()]
    return sum(t.sum() * 0.0 for t in floats)
