"""Which blocks of the attention matrix each ring step computes, and how: skipped, whole, causal or masked.

The sequence is cut into ``g·S`` equal chunks and rank ``r`` of ``S`` holds ``g`` of them (``assignment[r]``, in
increasing order; by default ``g = 2``, head-tail: chunks ``r`` and ``2·S−1−r``), for its queries and for its keys.
At ring step ``j`` it attends its queries to the keys of rank ``j``: ``g × g`` sub-blocks (its query chunks × rank
``j``'s key chunks), each of one kind:

* ``skip`` — the mask drops every score in it (the future under a causal mask, another document, outside a sliding
  window, padded keys): no kernel call;
* ``full`` — the mask keeps every score: a kernel call without a mask;
* ``causal`` — a diagonal sub-block (queries and keys of the same chunk) with exactly the causal pattern: a kernel
  call with ``is_causal=True``;
* ``masked`` — anything else: a kernel call with the mask's block as an additive bias.

A step's live sub-blocks run in as few calls as possible (one call when every query chunk needs the same keys in the
same way, as torch's load-balanced causal ring does; otherwise one per run of adjacent query chunks that need the same
keys the same way). The kinds come from the mask once (one host read per mask: a model that passes one mask to every
layer reads it once per call), or, without a mask, from ``is_causal``. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_parallel.parallelize.context.kernels import dropped
from lightning_parallel.parallelize.context.sequence import head_tail

SKIP, FULL, CAUSAL, MASKED = "skip", "full", "causal", "masked"

Kinds = tuple[tuple[str, ...], ...]  # [query chunk][key chunk] of one ring step


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a ring step: this rank's query ``rows`` against the source rank's key ``chunks``."""

    rows: slice
    chunks: tuple[int, ...]  # indices among the source rank's chunks (0 .. g-1), increasing
    kind: str  # FULL, CAUSAL or MASKED


@dataclass(frozen=True)
class RingPlan:
    """The kernel calls of every ring step for this rank's queries (``steps[j]``: against rank ``j``'s keys)."""

    rank: int
    size: int
    chunk: int
    kinds: tuple[Kinds, ...]  # [source rank][query chunk][key chunk]
    steps: tuple[tuple[BlockCall, ...], ...]
    assignment: tuple[tuple[int, ...], ...] = ()  # each rank's global chunks (empty: head-tail)

    @property
    def pairs(self) -> tuple[tuple[int, ...], ...]:
        return self.assignment or head_tail(self.size)

    def key_columns(self, source: int, chunks: tuple[int, ...]) -> list[slice]:
        """The global key positions (columns of a whole-sequence mask) of ``source``'s ``chunks``."""
        owned = self.pairs[source]
        return [slice(owned[d] * self.chunk, (owned[d] + 1) * self.chunk) for d in chunks]

    def mask_block(self, mask: Tensor, source: int, call: BlockCall) -> Tensor:
        """``mask``'s block for ``call`` (``mask``: this rank's query rows × every key in global order)."""
        rows = mask if mask.size(-2) == 1 else mask[..., call.rows, :]
        if rows.size(-1) == 1:
            return rows
        columns = [rows[..., cols] for cols in self.key_columns(source, call.chunks)]
        return columns[0] if len(columns) == 1 else torch.cat(columns, -1)

    @property
    def computed_fraction(self) -> float:
        """The fraction of this rank's score sub-blocks that are computed (not skipped)."""
        flat = [kind for step in self.kinds for row in step for kind in row]
        return sum(kind != SKIP for kind in flat) / len(flat)

    @property
    def work(self) -> tuple[float, int]:
        """This rank's computed score sub-blocks (``chunk × chunk`` each; a causal diagonal one counts ½, as a
        causal kernel computes about half of it) and the number it skips."""
        flat = [kind for step in self.kinds for row in step for kind in row]
        return sum(0.5 if kind == CAUSAL else 1.0 for kind in flat if kind != SKIP), sum(kind == SKIP for kind in flat)


def _row_call(row: tuple[str, ...]) -> tuple[tuple[int, ...], str]:
    """The key chunks one query chunk needs from a source, and how (one kernel call)."""
    live = tuple(d for d, kind in enumerate(row) if kind != SKIP)
    found = {row[d] for d in live}
    return live, FULL if found == {FULL} else CAUSAL if len(live) == 1 and found == {CAUSAL} else MASKED


def _calls(kinds: Kinds, source: int, rank: int, chunk: int) -> tuple[BlockCall, ...]:
    g = len(kinds)
    every = slice(0, g * chunk)
    flat = [kind for row in kinds for kind in row]
    if all(kind == SKIP for kind in flat):
        return ()
    if all(kind == FULL for kind in flat):
        return (BlockCall(every, tuple(range(g)), FULL),)
    causal = tuple(tuple(CAUSAL if d == c else FULL if d < c else SKIP for d in range(g)) for c in range(g))
    if source == rank and kinds == causal:
        # This rank's own keys under the causal pattern: its chunks' positions increase, so the causal mask of its
        # local order is the global one (torch's first ring step).
        return (BlockCall(every, tuple(range(g)), CAUSAL),)
    per_row = [_row_call(row) for row in kinds]
    if all(needs == per_row[0] for needs in per_row) and per_row[0][1] != CAUSAL:
        return (BlockCall(every, *per_row[0]),)  # every query chunk needs the same keys the same way: one call
    if MASKED in flat and SKIP not in flat:
        return (BlockCall(every, tuple(range(g)), MASKED),)
    calls, start = [], 0
    for c in range(1, g + 1):  # runs of adjacent query chunks that need the same keys the same way
        if c < g and per_row[c] == per_row[start] and per_row[c][1] != CAUSAL:
            continue
        live, kind = per_row[start]
        if live:
            calls.append(BlockCall(slice(start * chunk, c * chunk), live, kind))
        start = c
    return tuple(calls)


def _plan(rank: int, size: int, chunk: int, kinds: list[list[list[str]]],
          assignment: tuple[tuple[int, ...], ...]) -> RingPlan:
    frozen = tuple(tuple(tuple(row) for row in step) for step in kinds)
    steps = tuple(_calls(frozen[j], j, rank, chunk) for j in range(size))
    return RingPlan(rank, size, chunk, frozen, steps, assignment)


def plan_without_mask(rank: int, size: int, local_length: int, is_causal: bool,
                      assignment: tuple[tuple[int, ...], ...] | None = None) -> RingPlan:
    """The plan for no mask: every block whole, or the causal pattern of the chunks' layout (default head-tail)."""
    pairs = assignment or head_tail(size)
    kinds = [[[FULL if not is_causal or kc < qc else CAUSAL if kc == qc else SKIP for kc in pairs[j]]
              for qc in pairs[rank]] for j in range(size)]
    return _plan(rank, size, local_length // len(pairs[rank]), kinds, pairs)


def plan_for_mask(mask: Tensor, rank: int, size: int, local_length: int,
                  assignment: tuple[tuple[int, ...], ...] | None = None) -> RingPlan:
    """The plan for ``mask``: this rank's ``local_length`` query rows (or one row broadcast) × the whole sequence's
    keys in global order (or one column broadcast), 4-d, with the chunks laid out as ``assignment`` (default
    head-tail). One host read."""
    pairs = assignment or head_tail(size)
    g = len(pairs[rank])
    n = g * size
    chunk = local_length // g
    full_mask = mask.expand(*mask.shape[:-2], local_length, n * chunk)
    kept = full_mask if mask.dtype == torch.bool else full_mask == 0
    drop = dropped(full_mask)
    blocks = lambda t: t.unflatten(-1, (n, chunk)).unflatten(-3, (g, chunk))  # noqa: E731  [.., g, C, n, C]
    kept6, drop6 = blocks(kept), blocks(drop)
    live = (~drop6).flatten(0, 1).any(0).any(1).any(-1)  # [g, n]
    whole = kept6.flatten(0, 1).all(0).all(1).all(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=mask.device).tril()
    causal = []
    for c, qc in enumerate(pairs[rank]):
        keep, gone = kept6[:, :, c, :, qc, :], drop6[:, :, c, :, qc, :]
        causal.append(((keep == lower) & (keep | gone)).all())
    flags = torch.cat([live.flatten(), whole.flatten(), torch.stack(causal)]).tolist()
    live_flags, whole_flags, causal_flags = flags[:g * n], flags[g * n:2 * g * n], flags[2 * g * n:]

    def kind(c: int, qc: int, kc: int) -> str:
        index = c * n + kc
        if not live_flags[index]:
            return SKIP
        if whole_flags[index]:
            return FULL
        return CAUSAL if kc == qc and causal_flags[c] else MASKED

    kinds = [[[kind(c, qc, kc) for kc in pairs[j]] for c, qc in enumerate(pairs[rank])] for j in range(size)]
    return _plan(rank, size, chunk, kinds, pairs)


__all__ = ["BlockCall", "CAUSAL", "FULL", "MASKED", "RingPlan", "SKIP", "plan_for_mask", "plan_without_mask"]
