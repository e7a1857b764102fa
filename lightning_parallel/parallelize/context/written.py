"""Attention written out by hand (``q @ k.transpose(-1, -2)``, softmax, ``@ v``) under context parallelism.

Models that write their attention in matrix products (GPT-Neo, XGLM, XLM, RoFormer, OpenAI GPT, ...) never call
``F.scaled_dot_product_attention``: under context parallelism each rank would attend within its own part of the
sequence. Here the products themselves are recognised by their shapes, inside the model call's torch function mode:

* **scores**: queries ``[..., L_local, d]`` times transposed keys ``[..., d, L_local]`` (both with batch dims, so
  neither is a weight): the keys are all-gathered along the sequence in global order, so the product is this rank's
  query rows against every key, ``[..., L_local, L]``. The gather's backward reduce-scatters, so each rank's keys get
  the gradient of every rank's queries.
* **weighted values**: such rows ``[..., L_local, L]`` times values ``[..., L_local, d]``: the values are gathered
  the same way, and the result is this rank's rows again, ``[..., L_local, d]``.

Whatever the model does to the scores between the two (scaling, soft-capping, a mask, softmax, dropout) runs on its
rows as written; a mask over the whole sequence (``[..., L, L]``: transformers' mask builders, or one followed over
the whole sequence by :mod:`.whole`) is read at this rank's rows when it meets them. This is all-gather context
parallelism (as Llama 3 trained), not a ring: each rank holds one layer's keys and values of the whole sequence and
its own rows of the scores. The splitter's check at the first call (the split call against the whole one) refuses a
model this reading gets wrong. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import context_parallel_exchange
from lightning_parallel.parallelize.context.sequence import SequenceLayout

#: Matrix products a hand-written attention takes its scores and weighted values with.
ADDED_PRODUCTS = {torch.baddbmm, Tensor.baddbmm}  # input + scores (ALiBi and position biases)
PRODUCTS = {torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, *ADDED_PRODUCTS}


class WrittenAttention:
    """The scores rows (``[..., L_local, L]``) made inside one model call, and the products that make and use them.

    Args:
        layout: The sequence being processed and this rank's part of it.
        group: The context-parallel ranks.
        whole_of: A tensor's whole-sequence version where one is known (:meth:`.whole.WholeSequence.of`), else None.
        module_tensors: ``id()`` of the module's parameters and buffers (never keys or values).
    """

    def __init__(self, layout: SequenceLayout, group: dist.ProcessGroup, whole_of: Callable[[Tensor], Tensor | None],
                 module_tensors: set[int]) -> None:
        self.layout, self.group, self.whole_of, self.module_tensors = layout, group, whole_of, module_tensors
        self._rows: dict[int, Tensor] = {}  # id -> scores rows made here (kept, so that ids stay their own)
        self.products = 0  # scores products taken over the whole sequence

    @property
    def active(self) -> bool:
        """Whether scores rows were made in this call (only then are other ops looked at)."""
        return bool(self._rows)

    def product(self, func: Callable, args: tuple, kwargs: dict, where: Callable[[], str]) -> Any:
        """``func(a, b)`` (or ``baddbmm(input, a, b, beta=, alpha=)``) with the keys or values gathered whole where it
        is a scores or weighted-values product; ``NotImplemented`` for any other product."""
        added = func in ADDED_PRODUCTS
        if added:  # baddbmm(input, batch1, batch2, *, beta, alpha), the batches by position or by name (BLOOM)
            named = dict(zip(("input", "batch1", "batch2"), args))
            named.update({k: v for k, v in kwargs.items() if k in ("input", "batch1", "batch2")})
            rest = {k: v for k, v in kwargs.items() if k not in named}
            args, kwargs = (named.get("input"), named.get("batch1"), named.get("batch2"), *args[3:]), rest
        operands = args[1:3] if added else args
        if len(operands) != 2 or (kwargs and not added) or not all(isinstance(t, Tensor) for t in operands):
            return NotImplemented
        a, b = operands
        if not self._activations(a, b):
            return NotImplemented
        local, length = self.layout.local_length, self.layout.length
        if a.size(-2) == local and self._transposed_keys(b) and a.size(-1) == b.size(-2):  # queries x keys
            keys = self._gathered(b, b.dim() - 1)
            self.products += 1
            if added:  # the added input (a bias, ALiBi) beside the rows over every key
                return self.run_beside_rows(func, (args[0], a, keys, *args[3:]), kwargs, where)
            return self.mark(func(a, keys))
        if not added and a.size(-2) == local and a.size(-1) == length and b.size(-2) == local:  # scores rows x values
            return func(a, self._gathered(b, b.dim() - 2))
        return NotImplemented

    def _transposed_keys(self, b: Tensor) -> bool:
        """Whether ``b`` reads as keys transposed, ``[..., d, L_local]``. Where ``d`` is the local length too, only
        a transposed layout (``k.transpose(-1, -2)``: unit stride along ``d``) says keys rather than values."""
        local = self.layout.local_length
        if b.size(-1) != local:
            return False
        return b.size(-2) != local or (b.stride(-2) == 1 and b.stride(-1) != 1)

    def touches_rows(self, args: tuple, kwargs: dict) -> bool:
        """Whether an op takes scores rows made here."""
        found = []
        tree_map(lambda t: found.append(True) if isinstance(t, Tensor) and id(t) in self._rows else None, (args, kwargs))
        return bool(found)

    def run_beside_rows(self, func: Callable, args: tuple, kwargs: dict, where: Callable[[], str]) -> Any:
        """``func`` on scores rows, its other tensors read over the whole sequence (masks, biases: their whole
        version where one is known, at this rank's rows); the result is rows again where it has their shape.

        Raises:
            ValueError: The op fails on the rows: the model sizes or masks its scores from this rank's part.
        """
        args, kwargs = tree_map(self._beside, args), tree_map(self._beside, kwargs)
        try:
            return self.mark(func(*args, **kwargs))
        except (RuntimeError, IndexError) as error:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            local, length = self.layout.local_length, self.layout.length
            # ValueError, not TypeError: Tensor's operators turn a TypeError into NotImplemented.
            raise ValueError(
                f"{where()} writes its attention out in matrix products, which context parallelism takes as this rank's "
                f"{local} queries against all {length} keys (the keys and values gathered whole); the model then sizes "
                f"or masks those scores from this rank's part of the sequence ({name}: {error}). Use "
                "F.scaled_dot_product_attention (attn_implementation='sdpa') or set context_parallel_size=1."
            ) from error

    def _beside(self, value: Any) -> Any:
        """A tensor an op combines with scores rows: its whole-sequence version where one is known (a padding
        mask, a position bias built from the inputs), read at this rank's rows where it spans the sequence there."""
        if not isinstance(value, Tensor) or id(value) in self._rows or id(value) in self.module_tensors:
            return value
        length = self.layout.length
        whole = self.whole_of(value)
        if whole is not None and whole.dim() >= 1 and whole.size(-1) in (1, length):
            value = whole
        if value.dim() >= 2 and value.size(-2) == length and value.size(-1) in (1, length):
            return value.index_select(value.dim() - 2, self.layout.positions(value.device))
        return value

    def mark(self, result: Any) -> Any:
        """Keep the scores rows among ``result`` (what follows them stays rows: scaled, masked, softmaxed)."""
        shape = (self.layout.local_length, self.layout.length)
        if isinstance(result, Tensor) and result.is_floating_point() and result.dim() >= 2 and tuple(result.shape[-2:]) == shape:
            self._rows[id(result)] = result
        return result

    def _activations(self, a: Tensor, b: Tensor) -> bool:
        """Both operands floating, batched (3-D or more: batch, heads) and not the module's own tensors."""
        return (a.is_floating_point() and b.is_floating_point() and a.dim() >= 3 and b.dim() >= 3
                and id(a) not in self.module_tensors and id(b) not in self.module_tensors)

    def _gathered(self, tensor: Tensor, dim: int) -> Tensor:
        """Every rank's part of ``tensor`` along ``dim``, in the sequence's order (differentiable)."""
        return _GatherWhole.apply(tensor, self.layout, self.group, dim)


class _GatherWhole(torch.autograd.Function):
    """All-gather along the sequence into its order; the backward reduce-scatters, so each rank's part gets the sum
    of every rank's gradient for it (each rank's queries used every rank's keys and values)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, layout: SequenceLayout, group: dist.ProcessGroup, dim: int) -> Tensor:
        with context_parallel_exchange():  # counted as context parallelism's traffic
            gathered = collectives.functional_all_gather(local, dim, group)
        ctx.layout, ctx.group, ctx.dim = layout, group, dim
        return gathered.index_select(dim, layout.global_order(local.device))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        layout, dim = ctx.layout, ctx.dim
        # Back into the ranks' parts concatenated in rank order, then each rank's part summed over the ranks.
        by_rank = torch.cat([layout.positions_of(rank, grad.device) for rank in range(layout.size)])
        with context_parallel_exchange():
            local = collectives.functional_reduce_scatter(grad.index_select(dim, by_rank), dim, ctx.group)
        return local, None, None, None


__all__ = ["PRODUCTS", "WrittenAttention"]
