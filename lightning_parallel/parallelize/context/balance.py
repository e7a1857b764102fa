"""Which chunks of a packed sequence each context-parallel rank takes, so that the ranks' attention work is even.

Ring attention skips the blocks of the attention matrix that the mask drops entirely (:mod:`.ring_plan`). Under one
causal mask over the whole sequence, head-tail chunking (rank ``r`` keeps chunks ``r`` and ``2·cp−1−r``) gives every
rank the same number of computed blocks. With packed documents (attention within each document only) most blocks
below the diagonal are dropped, and which ones depends on where the documents start: a rank whose chunks lie in a
long document computes many blocks, one whose chunks hold short documents few (measured: the busiest rank 1.15× the
mean at cp8 with 2k-token documents in 128k sequences, 1.66× at cp16 with 8k ones; ``benchmarks/cp_balance.py``).

The work of query chunk ``q`` is the number of key chunks it attends to (its diagonal block counts ½ when the kernel
runs it causal, 1 when a document starts inside it); a rank's work is the sum over its chunks, since every rank sees
every key. With ``g`` chunks per rank, the chunks sorted by work go, heaviest first, to the least-loaded rank that
has room (for ``g = 2`` this pairs the heaviest with the lightest, which minimises the busiest rank's work). Two
chunks per rank are too coarse for documents (a chunk's work is a few blocks), so ``g`` doubles (4, 8) until the
busiest rank is within :data:`TOLERANCE` of the mean; finer chunks also skip more of the masked area. Head-tail stays
where it is already within the tolerance (a single document). Any assignment is exact: the chunks are equal, and the
ring and the ops along the sequence read each rank's chunk indices from the layout. One host read of the document
starts per model call. No Lightning here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_parallel.parallelize.context.sequence import head_tail

Assignment = tuple[tuple[int, ...], ...]

#: The busiest rank's work over the mean that is accepted without finer chunks.
TOLERANCE = 1.10
#: Chunks per rank tried, in order.
CHUNKS_PER_RANK = (2, 4, 8)


def document_ids(position_ids: Tensor) -> Tensor | None:
    """``[batch, length]`` index of each token's document, from ``position_ids`` that restart per document (a token
    whose position is not the previous one's + 1 starts a document, as transformers detects packed sequences); ``None``
    when no row restarts."""
    if position_ids.dim() != 2 or position_ids.is_floating_point() or position_ids.size(1) < 2:
        return None
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts.any()):
        return None
    return torch.cat([torch.zeros_like(starts[:, :1]), starts], 1).long().cumsum(1)


def chunk_work(documents: Tensor, chunks: int) -> Tensor:
    """Per query chunk of ``chunks`` equal ones, the score blocks it computes under causal attention within
    ``documents`` (``[batch, length]`` ids of contiguous documents), over every row of the batch (a block is skipped
    only when every row drops it): ``float64 [chunks]``."""
    size = documents.size(1) // chunks
    first = documents[:, ::size][:, :chunks]  # [batch, chunks]: document at each chunk's first position
    last = documents[:, size - 1::size][:, :chunks]  # and at its last
    # Query chunk q sees key chunk k < q iff some document runs from k's end into q's start (documents are contiguous).
    shared = (last.unsqueeze(1) == first.unsqueeze(2)).any(0)  # [q, k]
    below = torch.ones(chunks, chunks, dtype=torch.bool, device=documents.device).tril(-1)
    off_diagonal = (shared & below).sum(1).double()
    diagonal = torch.where((first == last).all(0), 0.5, 1.0).double()  # a document starting inside: a masked block
    return off_diagonal + diagonal


def rank_work(work: Tensor, assignment: Assignment) -> list[float]:
    """Each rank's computed blocks under ``assignment`` (its chunks' work summed)."""
    values = work.tolist()
    return [sum(values[k] for k in owned) for owned in assignment]


def imbalance(loads: list[float]) -> float:
    """The busiest rank's work over the mean (1.0: even)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def balanced_assignment(work: Tensor, size: int) -> Assignment:
    """``work.numel() / size`` chunks per rank: the heaviest chunks first, each to the least-loaded rank with room
    (ties to the lower rank; each rank's chunks returned in increasing order)."""
    if work.numel() % size != 0:
        raise ValueError(f"Per-chunk work has {work.numel()} entries, not a multiple of {size} ranks.")
    per_rank = work.numel() // size
    values = work.tolist()
    owned: list[list[int]] = [[] for _ in range(size)]
    loads = [0.0] * size
    for k in sorted(range(len(values)), key=lambda k: (-values[k], k)):
        rank = min((r for r in range(size) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        owned[rank].append(k)
        loads[rank] += values[k]
    return tuple(tuple(sorted(chunks)) for chunks in owned)


def assignment_for_documents(documents: Tensor, size: int) -> tuple[Assignment, list[float]]:
    """The assignment for ``documents`` (``[batch, length]`` ids) over ``size`` ranks and each rank's work in score
    elements (blocks × chunk²): head-tail if within :data:`TOLERANCE`, else the fewest chunks per rank that are."""
    length = documents.size(1)
    work = chunk_work(documents, 2 * size)
    default = head_tail(size)
    loads = rank_work(work, default)
    best = (default, [w * (length // (2 * size)) ** 2 for w in loads])
    if imbalance(loads) <= TOLERANCE:
        return best
    best_ratio = imbalance(loads)
    for per_rank in CHUNKS_PER_RANK:
        if length % (per_rank * size) != 0:
            continue
        work = chunk_work(documents, per_rank * size)
        assignment = balanced_assignment(work, size)
        loads = rank_work(work, assignment)
        if imbalance(loads) < best_ratio:
            best_ratio = imbalance(loads)
            best = (assignment, [w * (length // (per_rank * size)) ** 2 for w in loads])
        if best_ratio <= TOLERANCE:
            break
    return best


def assignment_for(position_ids: Tensor | None, size: int) -> tuple[Assignment, list[float]] | None:
    """The chunk assignment for a call whose ``position_ids`` (whole sequence) may mark packed documents, with each
    rank's expected work (score elements); ``None`` without documents (the default head-tail layout)."""
    if position_ids is None or size == 1 or position_ids.size(-1) % (2 * size) != 0:
        return None
    documents = document_ids(position_ids)
    if documents is None:
        return None
    return assignment_for_documents(documents, size)


__all__ = ["Assignment", "CHUNKS_PER_RANK", "TOLERANCE", "assignment_for", "assignment_for_documents", "balanced_assignment",
           "chunk_work", "document_ids", "imbalance", "rank_work"]
