"""Clear errors where a split attention module computes with sizes the plan did not divide.

The plan divides the head counts and widths an attention module keeps (:data:`~lightning_parallel.parallelize.
tensor.apply.HEAD_ATTRIBUTES`); some modules compute with others, which then fail deep in torch with a shape
error on this rank's heads. Two cases are caught and explained here, naming the module and the fix:

- a module that reshapes by a size it reads from its *input* (TrOCR: ``bsz, tgt_len, embed_dim =
  hidden_states.size()``, then ``attn_output.reshape(bsz, tgt_len, embed_dim)``): the input is whole, the heads
  are not. :func:`explain_split_failures` re-raises a shape error from a split module's forward with what and
  why; the original error is kept as its cause.
- a module that chunks its heads into groups across the whole head axis (DiffLlama pairs head ``h`` with head
  ``h + H/2``: ``torch.chunk(attn_output, 2, dim=heads)``): on a rank's contiguous range of heads the chunks pair
  other heads, a silently wrong result. A chunk or split along a dimension of the rank's head count, seen in the
  module's first forward, stops with the reason.
- a model that replaces a split attention module in ``forward`` (BigBird swaps block-sparse attention for full
  attention when the sequence is short): the new module keeps whole head counts. :func:`refuse_replaced_modules`
  checks, when a split projection is called, that its attention module is still the one the plan divided.

No Lightning here.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_parallel.parallelize.tensor.projections import KEY_VALUE_HEADS, QUERY_HEADS, head_count

#: Phrases of torch's shape errors (view/reshape, broadcasting, cat, expand, matmul).
_SHAPE_ERRORS = ("is invalid for input of size", "must match the size of tensor", "Sizes of tensors must match",
                 "must match the existing size", "cannot be multiplied", "size mismatch", "shape mismatch",
                 "doesn't match the broadcast shape")


def explain_split_failures(modules: Mapping[str, nn.Module], split: list[str]) -> None:
    """Wrap the ``forward`` of each split module in ``split`` so that a shape error names it and the fix."""
    for fqn in split:
        module = modules[fqn]
        if "forward" in module.__dict__:  # already wrapped (or a forward set on the instance): leave it
            continue
        module.forward = _explained(fqn, module, type(module).forward.__get__(module))


def _explained(fqn: str, module: nn.Module, forward: Any) -> Any:
    kind = type(module).__name__

    checked = False

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal checked
        try:
            if checked:
                return forward(*args, **kwargs)
            checked = True  # the first call only: the check costs a Python call per torch function
            with _HeadChunks(fqn, kind, _local_head_counts(module)):
                return forward(*args, **kwargs)
        except RuntimeError as error:
            message = str(error)
            if not any(phrase in message for phrase in _SHAPE_ERRORS) or "tensor-parallel split" in message:
                raise
            raise RuntimeError(
                f"{fqn} ({kind}) failed on this rank's heads after the tensor-parallel split: {message.splitlines()[0]}. "
                f"Its forward computes with a size the plan does not divide (a width read from its input, or a "
                f"count it does not keep under a known name). Leave {fqn} replicated: give TensorParallelStrategy("
                f"plan={{pattern: style}}) without its projections."
            ) from error

    return wrapped


def refuse_replaced_modules(root: nn.Module, modules: Mapping[str, nn.Module], attentions: Mapping[str, list[str]]) -> None:
    """Hook the split projections of each attention in ``attentions`` (``{attention: [projection FQN]}``) to
    check, when called, that ``root`` still holds that attention module under its name."""
    for fqn, projections in attentions.items():
        parent_name, _, child = fqn.rpartition(".")
        if not child or not projections:
            continue
        check = _StillInPlace(fqn, weakref.ref(modules[parent_name] if parent_name else root), child, modules[fqn])
        for projection in projections:
            modules[projection].register_forward_pre_hook(check)


class _StillInPlace:
    def __init__(self, fqn: str, parent: weakref.ref, child: str, attention: nn.Module) -> None:
        self.fqn, self.parent, self.child = fqn, parent, child
        self.attention = weakref.ref(attention)
        self.kind = type(attention).__name__

    def __call__(self, *_: Any) -> None:
        parent = self.parent()
        if parent is None:
            return
        now = parent._modules.get(self.child)
        if now is not None and now is not self.attention():
            raise RuntimeError(
                f"{self.fqn} was replaced during forward by a new {type(now).__name__} (the tensor-parallel plan split "
                f"the {self.kind} that was there and divided its head counts; the new module keeps whole ones). Build "
                f"the model so that it does not swap modules in forward (BigBird: attention_type='original_full' where "
                f"sequences are shorter than block-sparse attention needs), or leave {self.fqn} replicated in the plan."
            )


def _local_head_counts(module: nn.Module) -> set[int]:
    """The query and key/value head counts ``module`` keeps (after the plan divided them: this rank's)."""
    return {found[0] for found in (head_count(module, QUERY_HEADS), head_count(module, KEY_VALUE_HEADS)) if found}


_CHUNKS = {torch.chunk, torch.Tensor.chunk, torch.split, torch.Tensor.split, torch.tensor_split, torch.Tensor.tensor_split}


def _pieces(func: Any, parts: Any, size: int) -> int:
    """How many pieces ``func`` cuts a dimension of ``size`` into."""
    if isinstance(parts, (list, tuple)):
        return len(parts) + (1 if func in (torch.tensor_split, torch.Tensor.tensor_split) else 0)
    if not isinstance(parts, int) or parts < 1:
        return 1
    if func in (torch.split, torch.Tensor.split):  # pieces of `parts` entries each
        return -(-size // parts)
    return min(parts, size)


class _HeadChunks(TorchFunctionMode):
    """Refuses ``chunk``/``split`` into several parts along a head dimension of a 4-D activation."""

    def __init__(self, fqn: str, kind: str, heads: set[int]) -> None:
        super().__init__()
        self.fqn, self.kind, self.heads = fqn, kind, heads

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _CHUNKS and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
            tensor, parts = args[0], args[1] if len(args) > 1 else kwargs.get("chunks", kwargs.get("split_size_or_sections"))
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            dim = dim % 4 if isinstance(dim, int) else None
            size = tensor.shape[dim] if dim is not None else None
            if dim not in (None, 0, 3) and size in self.heads and size > 1 and _pieces(func, parts, size) > 1:
                raise RuntimeError(
                    f"{self.fqn} ({self.kind}) splits its {size} heads on this rank into groups (a chunk/split along the "
                    f"head dimension {dim}), pairing heads across the whole head axis: after the tensor-parallel split "
                    f"each rank holds a contiguous range of heads, so the groups would pair other heads than on one "
                    f"device. Leave {self.fqn} replicated: give TensorParallelStrategy(plan={{pattern: style}}) without "
                    f"its projections."
                )
        return func(*args, **kwargs)
