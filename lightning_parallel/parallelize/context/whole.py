"""The whole sequence behind some of this rank's tensors: what mask builders need to see the whole sequence.

Inside the model call a rank holds its part of every sequence tensor. Attention masks must cover the whole
sequence's keys (:mod:`.masks`), so a mask builder (transformers', :mod:`.hf_masks`) is called with the whole
sequence's ``attention_mask`` and ``position_ids`` instead of this rank's. :class:`WholeSequence` knows them:

* the model call's inputs that the splitter cut (this rank's part -> the input as passed);
* positions the mode made global (``torch.arange(L_local)`` -> ``torch.arange(L)``);
* what a few cheap ops make of the integer and boolean ones (``+ 1``, ``unsqueeze``, ``expand``, ``view``, ``to``,
  comparisons, ...): the same op is applied to the whole tensor, so ``position_ids = torch.arange(L).unsqueeze(0)``
  or ``attention_mask.bool()`` stay known.

Nothing else is followed (no model computation runs twice). No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

#: Ops whose result on the whole tensor is the whole of their result on this rank's part (applied to both).
_FOLLOWED = {
    Tensor.__add__, Tensor.__radd__, Tensor.__sub__, Tensor.__rsub__, Tensor.__mul__, Tensor.__rmul__, torch.add,
    torch.sub, Tensor.add, Tensor.sub, Tensor.unsqueeze, torch.unsqueeze, Tensor.expand, Tensor.view, Tensor.reshape,
    torch.reshape, Tensor.to, Tensor.long, Tensor.int, Tensor.bool, Tensor.float, Tensor.double, Tensor.clone,
    Tensor.contiguous, Tensor.type_as, Tensor.__getitem__, Tensor.__eq__, Tensor.__ne__, Tensor.__ge__,
    Tensor.__gt__, Tensor.__le__, Tensor.__lt__, Tensor.ne, Tensor.eq,
}


class WholeSequence:
    """This rank's tensors (by identity) -> the whole sequence's, for a model call (see the module docstring)."""

    def __init__(self) -> None:
        self._whole: dict[int, tuple[Tensor, Tensor]] = {}  # id(part) -> (part kept alive, whole)

    def add(self, part: Tensor, whole: Tensor) -> None:
        self._whole[id(part)] = (part, whole)

    def of(self, part: Any) -> Tensor | None:
        """The whole tensor behind ``part``, if known."""
        entry = self._whole.get(id(part)) if isinstance(part, Tensor) else None
        return None if entry is None else entry[1]

    def follows(self, func: Callable, args: tuple) -> bool:
        """Whether ``func`` on ``args`` may be followed (cheap check, before the op runs)."""
        if not (self._whole and func in _FOLLOWED and args and id(args[0]) in self._whole):
            return False
        if args[0].is_floating_point():
            return False  # positions, ids and masks only: activations are never computed whole
        if func is Tensor.__getitem__:  # whole-length selections only: a slice sized for this rank's part is not
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return all(part is None or part is Ellipsis or part == slice(None) for part in index)
        return True

    def follow(self, func: Callable, args: tuple, kwargs: dict, result: Any) -> None:
        """Record the whole of ``result`` (``func`` applied to the whole of its known tensor arguments)."""
        if not isinstance(result, Tensor) or result.requires_grad:
            return
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if any(id(t) not in self._whole and t.dim() > 0 for t in tensors):
            return  # mixes in a tensor whose whole is unknown
        substituted = tree_map(lambda t: self._whole[id(t)][1] if isinstance(t, Tensor) and id(t) in self._whole else t,
                               (args, kwargs))
        try:
            whole = func(*substituted[0], **substituted[1])
        except (RuntimeError, IndexError, TypeError, ValueError):
            return  # the op does not apply to the whole tensor as to its part (a size written out)
        if isinstance(whole, Tensor):
            self.add(result, whole)


__all__ = ["WholeSequence"]
