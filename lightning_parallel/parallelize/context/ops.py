"""Ops that mix tokens along the split sequence, under context parallelism: made global, or refused.

Each rank holds two chunks of every sequence (head-tail by default, see :class:`~lightning_parallel.parallelize.context.sequence.
SequenceLayout`), so an op that runs along the sequence sees this rank's part only. Inside the model call
:class:`~lightning_parallel.parallelize.context.splitter.ContextParallelMode` sends such ops here:

* ``cumsum`` along the sequence dimension (dim 1: Hugging Face's position ids from ``attention_mask.cumsum(1)``
  or ``input_ids.ne(pad).cumsum(1)``) is made exact: each chunk's cumulative sum plus the totals of the chunks
  before it in global order (one small all-gather of two totals per rank); so is ``diff(x, dim=1, prepend=...)``
  (Hugging Face's packed-sequence check on position ids), from the last value of the chunk before each;
* a materialised attention mask that is exactly the causal mask of the global positions (or allows everything)
  becomes ``is_causal=True`` (or no mask); the ranks agree on that with one tiny all-reduce per mask;
* what cannot be made global cheaply — a 1-d convolution along the sequence, ``cumprod``/``cummax``/``cummin``/
  ``logcumsumexp``, other ``diff``s, ``flip`` and ``roll`` along it, ``cumsum`` along another dimension of the
  local length, a cumulative sum that needs gradients — is refused, naming the op and the module.

Dim 0 (the batch) is never treated as the sequence. No Lightning here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import context_parallel_exchange

if TYPE_CHECKING:
    from lightning_parallel.parallelize.context.sequence import SequenceLayout

#: Dimension of the sequence in the model call's ``[batch, sequence, ...]`` tensors.
SEQUENCE_DIM = 1

_CUMSUM = (torch.cumsum, Tensor.cumsum)
#: Ops along a dimension that mix tokens in a way that a cheap exchange cannot make global: name -> functions.
_SCANS = {
    "cumprod": (torch.cumprod, Tensor.cumprod),
    "cummax": (torch.cummax, Tensor.cummax),
    "cummin": (torch.cummin, Tensor.cummin),
    "logcumsumexp": (torch.logcumsumexp, Tensor.logcumsumexp),
    "diff": (torch.diff, Tensor.diff),  # made global for the first difference with a prepended column only
}
_FLIPS = {"flip": (torch.flip, Tensor.flip), "roll": (torch.roll, Tensor.roll)}
_CONVOLUTIONS = {"conv1d": (torch.conv1d,), "conv_transpose1d": (torch.conv_transpose1d,)}
_BY_FUNCTION = {func: name for table in ({"cumsum": _CUMSUM}, _SCANS, _FLIPS, _CONVOLUTIONS)
                for name, funcs in table.items() for func in funcs}


def sequence_op(func: Callable) -> str | None:
    """The name under which :func:`handle_sequence_op` handles ``func``, or ``None`` for any other function."""
    return _BY_FUNCTION.get(func)


def calling_module(module_names: dict[int, str]) -> str:
    """The innermost module of the model (by qualified name) whose ``forward`` is on the call stack now."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in module_names:
            return f"{module_names[id(owner)] or '<root>'} ({type(owner).__name__})"
        frame = frame.f_back
    return "<unknown module>"


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _dims(value: Any, ndim: int) -> list[int]:
    if value is None:
        return list(range(ndim))
    values = [value] if isinstance(value, int) else list(value)
    return [v % ndim for v in values]


def handle_sequence_op(name: str, func: Callable, args: tuple, kwargs: dict, layout: SequenceLayout,
                       group: dist.ProcessGroup | None, module_names: dict[int, str]) -> Any:
    """Run ``func`` (named ``name`` by :func:`sequence_op`) on this rank's part of the sequence: globally exact
    where that is cheap, refused where it would mix only this rank's tokens, untouched where it does not run
    along a dimension of the local length."""
    source = args[0] if args else kwargs.get("input")
    local = layout.local_length
    if not isinstance(source, Tensor) or source.dim() == 0:
        return func(*args, **kwargs)
    # Dim 0 is the batch of [batch, sequence, ...] (or tokens flattened across rows: expert routing, packing),
    # not a sequence this rank holds a part of; a convolution runs along the last dim of [batch, channels, length].
    if name in _CONVOLUTIONS:
        along = [2] if source.dim() == 3 and source.size(2) == local else []
    elif name in _FLIPS:
        dims = _argument(args, kwargs, 2 if name == "roll" else 1, "dims")
        along = [d for d in _dims(dims, source.dim()) if d > 0 and source.size(d) == local]
    else:
        dim = _argument(args, kwargs, 2, "dim", -1) if name == "diff" else _argument(args, kwargs, 1, "dim")
        dim %= source.dim()
        along = [dim] if dim > 0 and source.size(dim) == local else []
    if not along:
        return func(*args, **kwargs)
    if name == "cumsum" and along == [SEQUENCE_DIM] and not source.requires_grad and "out" not in kwargs:
        return global_cumsum(source, layout, group, dtype=kwargs.get("dtype"))
    if name == "diff" and along == [SEQUENCE_DIM] and not source.requires_grad and _first_difference(args, kwargs):
        return global_diff(source, layout, group, _argument(args, kwargs, 3, "prepend"))
    why = ("it needs gradients or writes to out= (only position-like cumulative sums, without gradients, are made "
           "global)"
           if name == "cumsum" and along == [SEQUENCE_DIM] else
           f"along dim {along[0]} (of {source.size(along[0])} = this rank's positions) it would mix only this rank's "
           "part of each sequence")
    raise NotImplementedError(
        f"{calling_module(module_names)} calls {name} on a tensor of shape {tuple(source.shape)} under context "
        f"parallelism: {why}, while the sequence of {layout.length} is split over {layout.size} ranks. Ops that "
        "run along the sequence (convolutions, scans, recurrences, flips) have no context-parallel form here; set "
        "context_parallel_size=1 for this model."
    )


def chunk_cumsum(local: Tensor, dim: int, dtype: torch.dtype | None = None, parts: int = 2) -> tuple[Tensor, Tensor]:
    """The cumulative sums of this rank's ``parts`` chunks (head and tail by default) along ``dim`` separately
    (``local``'s shape with ``dim`` split into ``(parts, chunk)``), and the chunks' totals (``dim`` of size
    ``parts``)."""
    chunk = local.size(dim) // parts
    sums = torch.cumsum(local.unflatten(dim, (parts, chunk)), dim + 1, dtype=dtype)
    return sums, sums.select(dim + 1, chunk - 1)


def order_chunks(gathered: Tensor, layout: SequenceLayout, dim: int) -> list[Tensor]:
    """Every rank's per-chunk values (``[ranks, ...]``, ``dim`` of size ``g``: its chunks in local order), in global
    chunk order."""
    # Global chunk k is chunk `slot` of the rank that holds it (head-tail: the head of rank k, or the tail of rank
    # 2·ranks−1−k).
    count = len(layout.assignment[0]) * layout.size
    return [gathered[rank].select(dim, slot) for rank, slot in map(layout.owner, range(count))]


def _gather_chunks(values: Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None, dim: int) -> list[Tensor]:
    """This rank's per-chunk ``values`` (``dim`` of size 2) from every rank, in global chunk order."""
    if group is None or layout.size == 1:
        if layout.size != 1:
            raise RuntimeError(f"An op along a sequence split over {layout.size} ranks needs their group.")
        return order_chunks(values.unsqueeze(0), layout, dim)
    with context_parallel_exchange():
        gathered = collectives.functional_all_gather(values, 0, group)
    return order_chunks(gathered.view(layout.size, *values.shape), layout, dim)


def chunk_offsets(ordered: list[Tensor], layout: SequenceLayout, dim: int) -> Tensor:
    """For this rank's head and tail chunks (``dim`` of size 2), the sum of the chunk totals before each, from
    every chunk's total in global order (:func:`order_chunks`)."""
    totals = torch.stack(ordered, dim)
    before = torch.cumsum(totals, dim) - totals  # exclusive prefix sums
    index = torch.tensor(layout.chunks_of(layout.rank), device=totals.device)
    return before.index_select(dim, index)


def global_cumsum(local: Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None,
                  dtype: torch.dtype | None = None, dim: int = SEQUENCE_DIM) -> Tensor:
    """``torch.cumsum`` along the split sequence dimension, over the whole sequence: this rank's slice of it."""
    sums, totals = chunk_cumsum(local, dim, dtype, len(layout.chunks_of(layout.rank)))
    offsets = chunk_offsets(_gather_chunks(totals, layout, group, dim), layout, dim)
    return (sums + offsets.unsqueeze(dim + 1)).flatten(dim, dim + 1)


def _first_difference(args: tuple, kwargs: dict) -> bool:
    # diff(x, n=1, dim=1, prepend=<one column>): as Hugging Face finds packed sequences from position ids.
    prepend = _argument(args, kwargs, 3, "prepend")
    return (_argument(args, kwargs, 1, "n", 1) == 1 and _argument(args, kwargs, 4, "append") is None
            and isinstance(prepend, Tensor) and prepend.dim() >= 2 and prepend.size(SEQUENCE_DIM) == 1)


def chunk_last(local: Tensor, dim: int, parts: int = 2) -> Tensor:
    """The last value of each of this rank's ``parts`` chunks along ``dim`` (``dim`` of size ``parts``)."""
    chunk = local.size(dim) // parts
    return local.unflatten(dim, (parts, chunk)).select(dim + 1, chunk - 1)


def diff_after(local: Tensor, ordered_lasts: list[Tensor], layout: SequenceLayout, prepend: Tensor,
               dim: int) -> Tensor:
    """This rank's slice of the global first difference, from every chunk's last value in global order."""
    parts = len(layout.chunks_of(layout.rank))
    chunk = local.size(dim) // parts
    chunks = local.unflatten(dim, (parts, chunk))
    # The value before each of this rank's chunks: the last of the chunk before it in global order, or `prepend`.
    before = torch.stack([(prepend.select(dim, 0) if k == 0 else ordered_lasts[k - 1]).to(chunks.dtype)
                          for k in layout.chunks_of(layout.rank)], dim)
    shifted = torch.cat([before.unsqueeze(dim + 1), chunks.narrow(dim + 1, 0, chunk - 1)], dim + 1)
    return (chunks - shifted).flatten(dim, dim + 1)


def global_diff(local: Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None, prepend: Tensor,
                dim: int = SEQUENCE_DIM) -> Tensor:
    """``torch.diff(x, dim=dim, prepend=prepend)`` over the whole sequence (``prepend``: the column before its
    first position, taken from the rank that holds that position): this rank's slice of it. Each chunk's first
    difference needs the last value of the chunk before it in global order (one small all-gather)."""
    parts = len(layout.chunks_of(layout.rank))
    return diff_after(local, _gather_chunks(chunk_last(local, dim, parts), layout, group, dim), layout, prepend, dim)


def mask_pattern(mask: Tensor, positions: Tensor) -> tuple[bool, bool, str]:
    """Whether an ``attn_mask`` over this rank's queries and keys (both at global ``positions``) is exactly the
    causal mask, and whether it allows every pair; with the first pair where it is neither, described."""
    if mask.dtype == torch.bool:
        allowed, blocked = mask, ~mask
    elif mask.is_floating_point():  # additive: 0 keeps a score, a large negative value (or -inf) drops it exactly
        allowed, blocked = mask == 0, mask <= torch.finfo(mask.dtype).min / 2
    else:  # not a mask SDPA takes: nothing recognised, refused below
        allowed = blocked = torch.zeros_like(mask, dtype=torch.bool)
    causal = positions.unsqueeze(1) >= positions.unsqueeze(0)  # [query, key]
    both = allowed | blocked
    is_causal = bool((both & (allowed == causal)).all())
    everything = bool(allowed.all())
    if is_causal or everything:
        return is_causal, everything, ""
    differs = (~both) | (allowed != causal)
    index = differs.nonzero()[0].tolist()
    query, key = positions[index[-2]].item(), positions[index[-1]].item()
    if not bool(both[tuple(index)]):
        value = mask[tuple(index)].item()
        return False, False, (f"at query position {query}, key position {key} (global) it adds {value} to the "
                              "score: an attention bias (ALiBi, relative positions)")
    if bool(causal[index[-2], index[-1]]):
        return False, False, (f"it blocks query position {query} from key position {key} (global), which the causal "
                              "mask allows: a sliding window shorter than the sequence, or a padded key")
    return False, False, (f"it lets query position {query} attend to the later key position {key} (global), which "
                          "the causal mask blocks: bidirectional or prefix attention with a mask")


def agree(flags: list[bool], group: dist.ProcessGroup | None, device: torch.device) -> list[bool]:
    """Each flag true on every rank of ``group`` (one tiny all-reduce), so that the ranks decide alike."""
    if group is None:
        return flags
    local = torch.tensor([int(f) for f in flags], device=device)
    with context_parallel_exchange():
        agreed = collectives.functional_all_reduce(local, "min", group)
    return [bool(v) for v in agreed.tolist()]


def mask_as_causal(mask: Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None) -> bool | None:
    """An ``attn_mask`` over this rank's queries and keys as ring attention's ``is_causal``: ``True`` for exactly
    the causal mask of the global positions, ``None`` for a mask that allows everything (no mask); any other mask
    is refused (``TypeError``, on every rank: the ranks agree on the answer)."""
    local = layout.local_length
    if tuple(mask.shape[-2:]) != (local, local):
        raise TypeError(f"scaled_dot_product_attention got an attn_mask of shape {tuple(mask.shape)} under context "
                        f"parallelism, where each rank holds {local} queries and keys.")
    causal, everything, where = mask_pattern(mask, layout.positions(mask.device))
    causal, everything = agree([causal, everything], group, mask.device)
    if not (causal or everything):
        raise TypeError(
            f"scaled_dot_product_attention got an attn_mask (shape {tuple(mask.shape)}) under context parallelism "
            "that is neither the causal mask nor all-allowing: "
            f"{where or 'it differs from the causal mask at the positions of another context-parallel rank'}. "
            "Ring attention runs is_causal=True or no mask: a sliding window shorter than the sequence, padding "
            "(zeros in attention_mask) and attention biases (ALiBi) are not supported; use full sequences without "
            "padding, or set context_parallel_size=1."
        )
    return None if everything else True


__all__ = ["agree", "calling_module", "chunk_cumsum", "chunk_last", "chunk_offsets", "diff_after", "global_cumsum",
           "global_diff", "handle_sequence_op", "mask_as_causal", "mask_pattern", "order_chunks", "sequence_op"]
