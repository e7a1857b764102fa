"""Which blocks of the attention matrix each ring step computes, and how: skipped, whole, causal or masked.

Rank ``r`` of ``S`` holds two chunks of every sequence of ``2·S`` chunks (head-tail: chunks ``r`` and
``2·S−1−r``), for its queries and for its keys. At ring step ``j`` it attends its queries to the keys of rank
``j``: four sub-blocks (its head and tail query chunks × rank ``j``'s head and tail key chunks), each of one kind:

* ``skip`` — the mask drops every score in it (the future under a causal mask, another document, outside a sliding
  window, padded keys): no kernel call;
* ``full`` — the mask keeps every score: a kernel call without a mask;
* ``causal`` — a diagonal sub-block (queries and keys of the same chunk) with exactly the causal pattern: a kernel
  call with ``is_causal=True``;
* ``masked`` — anything else: a kernel call with the mask's block as an additive bias.

A step's live sub-blocks run in as few calls as possible (one call when both query chunks need the same keys in the
same way, as torch's load-balanced causal ring does). The kinds come from the mask once (one host read per mask: a
model that passes one mask to every layer reads it once per call), or, without a mask, from ``is_causal``.
No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_parallel.parallelize.context.kernels import dropped

SKIP, FULL, CAUSAL, MASKED = "skip", "full", "causal", "masked"


@dataclass(frozen=True)
class BlockCall:
    """One kernel call of a ring step: this rank's query ``rows`` against the source rank's key ``chunks``."""

    rows: slice
    chunks: tuple[int, ...]  # 0: the source rank's head chunk, 1: its tail chunk
    kind: str  # FULL, CAUSAL or MASKED


@dataclass(frozen=True)
class RingPlan:
    """The kernel calls of every ring step for this rank's queries (``steps[j]``: against rank ``j``'s keys)."""

    rank: int
    size: int
    chunk: int
    kinds: tuple[tuple[tuple[str, str], tuple[str, str]], ...]  # [source rank][query chunk][key chunk]
    steps: tuple[tuple[BlockCall, ...], ...]

    def key_columns(self, source: int, chunks: tuple[int, ...]) -> list[slice]:
        """The global key positions (columns of a whole-sequence mask) of ``source``'s ``chunks``."""
        ends = []
        for d in chunks:
            index = source if d == 0 else 2 * self.size - 1 - source
            ends.append(slice(index * self.chunk, (index + 1) * self.chunk))
        return ends

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


def _query_chunk(rank: int, size: int, c: int) -> int:
    return rank if c == 0 else 2 * size - 1 - rank


def _key_chunk(source: int, size: int, d: int) -> int:
    return source if d == 0 else 2 * size - 1 - source


def _calls(kinds: tuple[tuple[str, str], tuple[str, str]], source: int, rank: int, chunk: int) -> tuple[BlockCall, ...]:
    every = slice(0, 2 * chunk)
    flat = [kinds[c][d] for c in (0, 1) for d in (0, 1)]
    if all(kind == SKIP for kind in flat):
        return ()
    if all(kind == FULL for kind in flat):
        return (BlockCall(every, (0, 1), FULL),)
    if source == rank and kinds == ((CAUSAL, SKIP), (FULL, CAUSAL)):
        # This rank's own keys under the causal pattern: its head then tail positions increase, so the causal mask
        # of its local order is the global one (torch's first ring step).
        return (BlockCall(every, (0, 1), CAUSAL),)
    per_row = []
    for c in (0, 1):
        live = tuple(d for d in (0, 1) if kinds[c][d] != SKIP)
        found = {kinds[c][d] for d in live}
        kind = FULL if found == {FULL} else CAUSAL if len(live) == 1 and found == {CAUSAL} else MASKED
        per_row.append((slice(c * chunk, (c + 1) * chunk), live, kind))
    if per_row[0][1:] == per_row[1][1:]:  # both query chunks need the same keys the same way: one call
        return (BlockCall(every, per_row[0][1], per_row[0][2]),)
    if MASKED in flat and SKIP not in flat:
        return (BlockCall(every, (0, 1), MASKED),)
    return tuple(BlockCall(rows, live, kind) for rows, live, kind in per_row if live)


def _plan(rank: int, size: int, chunk: int, kinds: list[list[list[str]]]) -> RingPlan:
    frozen = tuple((tuple(step[0]), tuple(step[1])) for step in kinds)
    steps = tuple(_calls(frozen[j], j, rank, chunk) for j in range(size))
    return RingPlan(rank, size, chunk, frozen, steps)


def plan_without_mask(rank: int, size: int, local_length: int, is_causal: bool) -> RingPlan:
    """The plan for no mask: every block whole, or the causal pattern of the head-tail layout."""
    kinds = []
    for j in range(size):
        step = []
        for c in (0, 1):
            qc = _query_chunk(rank, size, c)
            row = []
            for d in (0, 1):
                kc = _key_chunk(j, size, d)
                row.append(FULL if not is_causal or kc < qc else CAUSAL if kc == qc else SKIP)
            step.append(row)
        kinds.append(step)
    return _plan(rank, size, local_length // 2, kinds)


def plan_for_mask(mask: Tensor, rank: int, size: int, local_length: int) -> RingPlan:
    """The plan for ``mask``: this rank's ``local_length`` query rows (or one row broadcast) × the whole sequence's
    keys in global order (or one column broadcast), 4-d. One host read."""
    chunk = local_length // 2
    full_mask = mask.expand(*mask.shape[:-2], local_length, 2 * size * chunk)
    kept = full_mask if mask.dtype == torch.bool else full_mask == 0
    drop = dropped(full_mask)
    blocks = lambda t: t.unflatten(-1, (2 * size, chunk)).unflatten(-3, (2, chunk))  # noqa: E731  [.., 2, C, 2S, C]
    kept6, drop6 = blocks(kept), blocks(drop)
    live = (~drop6).flatten(0, 1).any(0).any(1).any(-1)  # [2, 2S]
    whole = kept6.flatten(0, 1).all(0).all(1).all(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=mask.device).tril()
    causal = []
    for c in (0, 1):
        qc = _query_chunk(rank, size, c)
        keep, gone = kept6[:, :, c, :, qc, :], drop6[:, :, c, :, qc, :]
        causal.append(((keep == lower) & (keep | gone)).all())
    flags = torch.cat([live.flatten(), whole.flatten(), torch.stack(causal)]).tolist()
    live_flags, whole_flags, causal_flags = flags[:4 * size], flags[4 * size:8 * size], flags[8 * size:]
    kinds = []
    for j in range(size):
        step = []
        for c in (0, 1):
            qc = _query_chunk(rank, size, c)
            row = []
            for d in (0, 1):
                kc = _key_chunk(j, size, d)
                index = c * 2 * size + kc
                if not live_flags[index]:
                    row.append(SKIP)
                elif whole_flags[index]:
                    row.append(FULL)
                elif kc == qc and causal_flags[c]:
                    row.append(CAUSAL)
                else:
                    row.append(MASKED)
            step.append(row)
        kinds.append(step)
    return _plan(rank, size, chunk, kinds)


__all__ = ["BlockCall", "CAUSAL", "FULL", "MASKED", "RingPlan", "SKIP", "plan_for_mask", "plan_without_mask"]
