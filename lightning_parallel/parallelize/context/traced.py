"""Context parallelism inside traced graphs (pipeline stages): the model call's mode, for the aten ops export keeps.

A pipeline stage is a graph torch.export traced for this rank's part of the sequence. Its Python-level calls
(``F.scaled_dot_product_attention``, ``torch.arange``, ``table[:L]``) are aten ops there, which
:class:`TracedContextParallelMode` maps onto :class:`~lightning_parallel.parallelize.context.splitter.ContextParallelMode`'s
handlers: attention as a ring, local positions made global. Ops along the sequence that the eager mode makes
global or refuses (cumsum, scans, flips, 1-d convolutions) are refused here by name (their aten forms are not
mapped yet). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_parallel.parallelize.context.splitter import ContextParallelMode

aten = torch.ops.aten

_ATTENTION = {aten.scaled_dot_product_attention.default}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_SLICE = {aten.slice.Tensor}
#: aten forms of the ops along the sequence the eager mode handles: refused inside traced stages.
_REFUSED = {
    aten.cumsum.default: "cumsum", aten.cumprod.default: "cumprod", aten.cummax.default: "cummax",
    aten.cummin.default: "cummin", aten.logcumsumexp.default: "logcumsumexp", aten.flip.default: "flip",
    aten.roll.default: "roll", aten.conv1d.default: "conv1d", aten.convolution.default: "convolution",
}


class TracedContextParallelMode(ContextParallelMode):
    """:class:`ContextParallelMode` for graphs of aten ops (traced pipeline stages)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _ATTENTION:
            return self._attention(*args, **kwargs)
        if func in _ARANGE:
            bounds = {k: v for k, v in kwargs.items() if k in ("dtype", "device")}
            positions = self._global_arange(tuple(args), bounds)
            if positions is not None:
                self.made_global = True
                return positions
        elif func in _SLICE and args and id(args[0]) in self.module_tensors:
            table, dim, start, end, step = (*args, *(None,) * (5 - len(args)))[:5]
            dim = 0 if dim is None else dim
            index = (slice(None),) * (dim % table.dim()) + (slice(start, end, step),)
            rows = self._global_rows(table, index)
            if rows is not None:
                self.made_global = True
                return rows
        elif func in _REFUSED and self._along_sequence(args, kwargs):
            raise TypeError(
                f"{_REFUSED[func]} along the sequence inside a pipeline stage under context parallelism is not "
                "supported yet (each rank holds part of the sequence). Set context_parallel_size=1 or "
                "pipeline_parallel_size=1."
            )
        return super().__torch_function__(func, types, args, kwargs)

    def _along_sequence(self, args: tuple, kwargs: dict) -> bool:
        tensor = args[0] if args else None
        return isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.size(1) == self.layout.local_length


class StageSequenceSplit:
    """Context parallelism for a pipeline: the model call's sequence split before the stages, their graphs run
    under :class:`TracedContextParallelMode`, the last stage's per-token outputs gathered whole for the user's step.

    Args:
        group: The context-parallel ranks; ``rank`` this one's index in it, ``size`` how many.
    """

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def split(self, args: tuple, kwargs: dict, forward: Any = None) -> tuple[Any, tuple, dict]:
        """The sequence layout of a model call, and its inputs with every ``[batch, sequence, ...]`` tensor split.

        ``forward`` (the called module's ``forward``) names positional arguments, so that ``position_ids`` passed by
        position are seen as by keyword."""
        from torch.utils._pytree import tree_flatten, tree_map

        from lightning_parallel.parallelize.context.sequence import SEQUENCE_DIM, SequenceLayout, split_sequence

        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() >= 2]
        if not tensors:
            raise TypeError("Context parallelism splits the model call's [batch, sequence, ...] inputs along dim 1; "
                            "the pipelined module was called without one.")
        first = tensors[0]
        layout = SequenceLayout(first.size(SEQUENCE_DIM), self.size, self.rank)
        batch = first.size(0)
        _refuse_explicit_positions(_argument(forward, args, kwargs, "position_ids"), layout)

        def split(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(SEQUENCE_DIM) == layout.length \
                    and value.size(0) in (batch, 1):
                return split_sequence(value, layout)
            return value

        args, kwargs = tree_map(split, (args, kwargs))
        return layout, args, kwargs

    def mode(self, layout: Any, module_tensors: set[int]) -> TracedContextParallelMode:
        return TracedContextParallelMode(layout, self.group, module_tensors)

    def check_attention_ran(self, mode: TracedContextParallelMode, pp_group: Any) -> None:
        """After the first step: some stage must have run attention as a ring (agreed over the pipeline's ranks).

        Raises:
            RuntimeError: No stage called ``scaled_dot_product_attention``: attention written by hand (or Hugging
                Face's ``attn_implementation="eager"``) would attend within each rank's part only.
        """
        from lightning_parallel import collectives
        from lightning_parallel.measure.collectives import outside_training

        calls = torch.tensor([mode.attention_calls], dtype=torch.int64, device=collectives.group_device(pp_group))
        with outside_training():
            collectives.all_reduce(calls, collectives.SUM, pp_group)
        if int(calls) == 0:
            raise RuntimeError(
                "No pipeline stage made a scaled_dot_product_attention call under context parallelism: attention "
                "written by hand (or Hugging Face's attn_implementation='eager') would attend only within this rank's "
                "part of the sequence. Use F.scaled_dot_product_attention (attn_implementation='sdpa'), or set "
                "context_parallel_size=1."
            )

    def gather(self, output: Any, layout: Any) -> Any:
        """Per-token outputs of this rank's part made whole (differentiably, as the eager model call's are)."""
        from torch.utils._pytree import tree_map

        from lightning_parallel.parallelize.context.sequence import SEQUENCE_DIM, gather_sequence

        def gather(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(SEQUENCE_DIM) == layout.local_length:
                return gather_sequence(value, layout, self.group)
            return value

        return tree_map(gather, output)


def _argument(forward: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of ``forward``'s parameter ``name`` in a call with ``args, kwargs`` (``None`` where not given)."""
    if name in kwargs or forward is None:
        return kwargs.get(name)
    import inspect

    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return bound.arguments.get(name)


def _refuse_explicit_positions(position_ids: Any, layout: Any) -> None:
    """``position_ids`` given to a model call under cp inside pipelines: refused, saying why (ValueError).

    A traced stage sees only this rank's part of the sequence: the masks and position tables a model builds from
    positions it is given (packed documents restarting them, or plain positions used as indices) would be built
    from the part, where context parallelism runs only a causal or all-keeping mask. Checked on every call whatever
    the values (a first batch whose documents all span the block does not restart its positions, a later one does);
    no host read."""
    if not (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.size(1) == layout.length):
        return
    raise ValueError(
        f"The pipelined model call got position_ids ([batch, {layout.length}]) with "
        f"context_parallel_size={layout.size} and pipeline_parallel_size > 1: inside pipeline stages masks and "
        "positions are built from each rank's part of the sequence, so positions given to the model (packed "
        "documents restarting them, or explicit ones) are not supported there yet. Set pipeline_parallel_size=1 "
        "(context parallelism alone trains packed documents exactly), context_parallel_size=1, or let the model "
        "build its own positions."
    )
