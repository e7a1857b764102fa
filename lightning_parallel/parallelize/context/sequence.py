"""Which part of a sequence each context-parallel rank holds, and the differentiable split and gather.

The sequence is cut into ``g·cp`` equal chunks and each rank keeps ``g`` of them, in increasing order. By default
``g = 2`` and rank ``r`` keeps chunks ``r`` and ``2·cp−1−r`` (head-tail), so that under a causal mask every rank
does the same work; with packed documents finer chunks assigned by their work balance it better (:mod:`.balance`
chooses them, and the layout carries them as ``assignment``). The gather's backward hands each rank its slice of the (identical) output gradient,
scaled by ``cp`` (see :mod:`.splitter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import context_parallel_exchange

#: Dimension of the sequence in the model call's ``[batch, sequence, ...]`` tensors.
SEQUENCE_DIM = 1


def check_sequence_length(length: int, size: int) -> None:
    """Refuse a sequence that does not split into ``2 × size`` equal chunks (``ValueError`` with the fix)."""
    if length % (2 * size) != 0:
        raise ValueError(
            f"The sequence length {length} is not divisible by 2 × context_parallel_size = {2 * size}: each of the "
            f"{size} context-parallel ranks takes two equal chunks (head and tail, for causal load balance). Use "
            f"sequences whose length is a multiple of {2 * size} (pad them, or change the block size), or a "
            f"context_parallel_size that divides {length // 2 if length % 2 == 0 else length}/2."
        )


def head_tail(size: int) -> tuple[tuple[int, int], ...]:
    """The default assignment of ``2·size`` chunks: rank ``r`` keeps chunks ``r`` and ``2·size−1−r``."""
    return tuple((rank, 2 * size - 1 - rank) for rank in range(size))


def check_assignment(assignment: tuple[tuple[int, ...], ...], size: int, length: int) -> None:
    """Refuse an assignment that is not ``g`` increasing chunks per rank covering ``g·size`` chunks once each, of a
    ``length`` that divides into them."""
    g = len(assignment[0]) if assignment else 0
    flat = [k for owned in assignment for k in owned]
    if (len(assignment) != size or g == 0 or any(len(owned) != g for owned in assignment)
            or sorted(flat) != list(range(g * size)) or any(list(owned) != sorted(set(owned)) for owned in assignment)
            or length % (g * size) != 0):
        raise ValueError(
            f"A context-parallel chunk assignment must give each of the {size} ranks the same number of chunks "
            f"(increasing) of a sequence of {length} cut into equal chunks, each chunk once; got {assignment}."
        )


@dataclass(frozen=True)
class SequenceLayout:
    """Which positions of a sequence of ``length`` each of ``size`` ranks holds: ``g`` of ``g·size`` equal chunks
    each, chunks ``assignment[r]`` for rank ``r`` (default head-tail: ``g = 2``, chunks r, 2·size−1−r)."""

    length: int
    size: int
    rank: int
    assignment: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        check_sequence_length(self.length, self.size)
        if self.assignment is None:
            object.__setattr__(self, "assignment", head_tail(self.size))
        else:
            check_assignment(self.assignment, self.size, self.length)

    @property
    def local_length(self) -> int:
        return self.length // self.size

    @property
    def chunk(self) -> int:
        """Positions per chunk."""
        return self.length // (len(self.assignment[0]) * self.size)

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The global indices of ``rank``'s chunks, in its local order (increasing)."""
        return self.assignment[rank]

    def owner(self, index: int) -> tuple[int, int]:
        """Which rank holds global chunk ``index``, and as which of its chunks (its local index)."""
        for rank, owned in enumerate(self.assignment):
            if index in owned:
                return rank, owned.index(index)
        raise IndexError(f"No chunk {index} in {self.assignment}.")

    def positions_of(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions of ``rank``'s tokens, in its local order."""
        chunk = self.chunk
        return torch.cat([torch.arange(k * chunk, (k + 1) * chunk, device=device) for k in self.chunks_of(rank)])

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        """Global positions of this rank's tokens, in local order."""
        return self.positions_of(self.rank, device)

    def global_order(self, device: torch.device | str | None = None) -> Tensor:
        """For each global position, where it sits in the ranks' local slices concatenated in rank order."""
        concatenated = torch.cat([self.positions_of(rank, device) for rank in range(self.size)])
        return torch.argsort(concatenated)


def split_sequence(tensor: Tensor, layout: SequenceLayout, dim: int = SEQUENCE_DIM) -> Tensor:
    """This rank's head and tail chunks of ``tensor`` along ``dim`` (differentiable)."""
    return tensor.index_select(dim, layout.positions(tensor.device))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: Tensor, layout: SequenceLayout, group: dist.ProcessGroup, dim: int) -> Tensor:
        # Functional collectives: what the monitor counts (as context-parallel traffic, inside the exchange).
        with context_parallel_exchange():
            gathered = collectives.functional_all_gather(local, dim, group)
        ctx.layout, ctx.dim = layout, dim
        return gathered.index_select(dim, layout.global_order(local.device))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # Every cp rank computed the same loss from the same whole outputs, so the gradients are identical:
        # no communication, this rank's slice, ×cp so that averaging over dp × cp sums the cp ranks' parts.
        layout: SequenceLayout = ctx.layout
        return split_sequence(grad, layout, ctx.dim) * layout.size, None, None, None


def gather_sequence(tensor: Tensor, layout: SequenceLayout, group: dist.ProcessGroup, dim: int = SEQUENCE_DIM) -> Tensor:
    """The whole sequence from every rank's slice of it, in global order (see the module docstring for the gradient)."""
    return _GatherSequence.apply(tensor, layout, group, dim)


__all__ = ["SEQUENCE_DIM", "SequenceLayout", "check_assignment", "check_sequence_length", "gather_sequence", "head_tail",
           "split_sequence"]
