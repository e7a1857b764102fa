"""The whole sequence behind some of this rank's tensors: masks built inside the model, over the whole sequence.

Inside the model call a rank holds its part of every sequence tensor. Attention masks must cover the whole
sequence's keys (:mod:`.masks`), but a model that builds its mask in its forward — from position ids, document ids,
an ``attention_mask``, ``torch.arange`` — builds it from its part: its queries × its own keys. :class:`WholeSequence`
follows those computations on the whole sequence alongside:

* the model call's inputs that the splitter cut (this rank's part -> the input as passed);
* positions the mode made global (``torch.arange(L_local)`` -> ``torch.arange(L)``);
* what elementwise, comparison, logical and view ops make of those, without gradients, where every other tensor
  they take is known whole too or has no dim of this rank's length (a constant: ALiBi's slopes): the same op runs on
  the whole tensors, so ``doc[:, :, None] == doc[:, None, :]``, ``pos[:, None] >= pos[None, :]``,
  ``-(q - k).abs() * slopes`` or ``attention_mask.bool()`` are known over the whole sequence.

Ring attention then reads the whole mask's rows for this rank; transformers' mask builders are called with the whole
inputs (:mod:`.hf_masks`). Activations are never followed (they need gradients, or derive from parameters), nor
floating inputs of the call (``inputs_embeds``), so no model computation runs twice. The whole masks cost what they
cost on one device. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

_T = Tensor
#: Ops whose result on the whole tensors is the whole of their result on this rank's part (applied to both).
_FOLLOWED = {
    # arithmetic
    _T.__add__, _T.__radd__, _T.__sub__, _T.__rsub__, _T.__mul__, _T.__rmul__, _T.__truediv__, _T.__rtruediv__,
    _T.__floordiv__, _T.__mod__, _T.__neg__, _T.__abs__, _T.abs, _T.neg, _T.add, _T.sub, _T.mul, _T.div, _T.clamp,
    _T.clamp_min, _T.clamp_max, torch.add, torch.sub, torch.mul, torch.div, torch.abs, torch.neg, torch.clamp,
    torch.remainder, torch.floor_divide, _T.remainder,
    # comparisons and logic
    _T.__eq__, _T.__ne__, _T.__ge__, _T.__gt__, _T.__le__, _T.__lt__, _T.eq, _T.ne, _T.ge, _T.gt, _T.le, _T.lt,
    torch.eq, torch.ne, torch.ge, torch.gt, torch.le, torch.lt, _T.__and__, _T.__or__, _T.__xor__, _T.__invert__,
    _T.__rand__, _T.__ror__, _T.logical_and, _T.logical_or, _T.logical_not, torch.logical_and, torch.logical_or,
    torch.logical_not, torch.bitwise_and, torch.bitwise_or, torch.bitwise_not,
    # selection
    torch.where, _T.where, _T.masked_fill, torch.masked_fill,
    # views, copies and dtypes
    _T.unsqueeze, torch.unsqueeze, _T.expand, _T.view, _T.reshape, torch.reshape, _T.to, _T.long, _T.int, _T.bool,
    _T.float, _T.double, _T.half, _T.bfloat16, _T.clone, _T.contiguous, _T.type_as, _T.__getitem__,
}


_IN_PLACE = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
             "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


class WholeSequence:
    """This rank's tensors (by identity) -> the whole sequence's, for a model call (see the module docstring)."""

    def __init__(self, local_length: int) -> None:
        self.local_length = local_length
        self._whole: dict[int, tuple[Tensor, Tensor]] = {}  # id(part) -> (part kept alive, whole)
        self._not_followed: set[int] = set()  # floating inputs of the call: known whole, never followed

    def add(self, part: Tensor, whole: Tensor, follow: bool = True) -> None:
        self._whole[id(part)] = (part, whole)
        if not follow:
            self._not_followed.add(id(part))

    def of(self, part: Any) -> Tensor | None:
        """The whole tensor behind ``part``, if known."""
        entry = self._whole.get(id(part)) if isinstance(part, Tensor) else None
        return None if entry is None else entry[1]

    def follows(self, func: Callable, args: tuple, kwargs: dict) -> bool:
        """Whether ``func`` on ``args`` is followed (a cheap check, before the op runs)."""
        if not self._whole or func not in _FOLLOWED or not args:
            return False
        known = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and id(t) in self._whole]
        if not known or any(id(t) in self._not_followed for t in known):
            return False
        if func is Tensor.__getitem__:  # whole-length selections only: a slice sized for this rank's part is not
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return all(part is None or part is Ellipsis or (isinstance(part, slice) and part == slice(None))
                       for part in index)
        return True

    def forget_written(self, func: Callable, args: tuple) -> None:
        """Before an in-place op (``masked_fill_``, ``x[i] = v``, ``+=``): the tensors it writes, and every known
        tensor sharing their memory, are no longer known whole (their whole was not written alike)."""
        if not self._whole or not args or not isinstance(args[0], Tensor):
            return
        name = getattr(func, "__name__", "")
        if not (name in _IN_PLACE or (name.endswith("_") and not name.endswith("__"))):
            return
        try:
            written = args[0].untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            written = None
        for key, (part, _) in list(self._whole.items()):
            same = part is args[0]
            if not same and written is not None:
                try:
                    same = part.untyped_storage().data_ptr() == written
                except (RuntimeError, NotImplementedError):
                    same = False
            if same:
                del self._whole[key]

    def follow(self, func: Callable, args: tuple, kwargs: dict, result: Any) -> None:
        """Record the whole of ``result``: ``func`` applied to the whole of its known tensor arguments."""
        if not isinstance(result, Tensor) or result.requires_grad:
            return
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and id(t) not in self._whole and (
                    t.requires_grad or self.local_length in tuple(t.shape)):
                return  # mixes in a tensor of this rank's part whose whole is unknown (or an activation)
        substituted = tree_map(lambda t: self._whole[id(t)][1] if isinstance(t, Tensor) and id(t) in self._whole else t,
                               (args, kwargs))
        try:
            whole = func(*substituted[0], **substituted[1])
        except (RuntimeError, IndexError, TypeError, ValueError):
            return  # the op does not apply to the whole tensor as to its part (a size written out)
        if isinstance(whole, Tensor):
            self.add(result, whole)


__all__ = ["WholeSequence"]
