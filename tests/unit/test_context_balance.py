"""Packed documents balanced over context-parallel ranks: the chunk layout chosen from the documents, and exactness.

The work each rank's ring plan computes must be what the balancer expected from the documents; the balancer must
bring realistic document mixes within 10% of the mean where head-tail does not; and ring attention, the ops along
the sequence (cumsum, diff) and whole models must stay exact under any chunk assignment (float64 vs one device,
simulated ranks on threads).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.parallelize.context.balance import (
    TOLERANCE,
    assignment_for,
    balanced_assignment,
    chunk_work,
    document_ids,
    imbalance,
    rank_work,
)
from lightning_parallel.parallelize.context.ring_attention import ring_attention
from lightning_parallel.parallelize.context.ring_plan import plan_for_mask
from lightning_parallel.parallelize.context.sequence import SequenceLayout, head_tail, split_sequence
from tests.unit.cp_simulated import run_ranks


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _mix(length: int, mean: int, seed: int) -> list[int]:
    """Document lengths as web text comes (log-normal, a long tail), packed until ``length`` and cut there."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < length:
        lengths.append(max(4, int(rng.lognormvariate(0.0, 1.0) * mean / 1.65)))
    lengths[-1] -= sum(lengths) - length
    return [n for n in lengths if n > 0]


def _block_diagonal(documents: torch.Tensor) -> torch.Tensor:
    length = documents.size(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]  # [batch, 1, L, L]


def test_documents_are_found_where_position_ids_restart():
    assert document_ids(torch.arange(8)[None]) is None
    assert document_ids(_positions([[3, 5], [8]])).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8]
    assert assignment_for(torch.arange(16)[None], 2) is None  # one document: head-tail, nothing chosen


@pytest.mark.parametrize("per_rank", [2, 4])
def test_the_ring_plans_compute_the_work_the_balancer_expects(per_rank):
    rows = [[5, 7, 4, 8], [9, 3, 12]]  # two rows, other boundaries: a block is skipped only where both drop it
    documents = document_ids(_positions(rows))
    size, length = 2, 24
    work = chunk_work(documents, per_rank * size)
    assignment = balanced_assignment(work, size)
    mask = _block_diagonal(documents)
    for rank in range(size):
        layout = SequenceLayout(length, size, rank, assignment)
        plan = plan_for_mask(mask.index_select(-2, layout.positions()), rank, size, layout.local_length, assignment)
        computed, skipped = plan.work
        assert computed == rank_work(work, assignment)[rank]
        assert computed + skipped > per_rank ** 2 * size * 0.5 and skipped > 0


@pytest.mark.parametrize("size, mean", [(8, 2048), (8, 8192), (16, 2048)])
def test_realistic_document_mixes_are_balanced_within_ten_percent(size, mean):
    length = 131072
    worst_head_tail, worst = 1.0, 1.0
    for seed in range(4):
        position_ids = _positions([_mix(length, mean, seed)])
        head_tail_loads = rank_work(chunk_work(document_ids(position_ids), 2 * size), head_tail(size))
        worst_head_tail = max(worst_head_tail, imbalance(head_tail_loads))
        assignment, loads = assignment_for(position_ids, size)
        worst = max(worst, imbalance(loads))
        assert sorted(k for owned in assignment for k in owned) == list(range(len(assignment[0]) * size))
    assert worst_head_tail > TOLERANCE  # what there was to fix
    assert worst <= TOLERANCE


def _assignment(size: int, per_rank: int, seed: int) -> tuple[tuple[int, ...], ...]:
    chunks = list(range(size * per_rank))
    random.Random(seed).shuffle(chunks)
    return tuple(tuple(sorted(chunks[r * per_rank:(r + 1) * per_rank])) for r in range(size))


@pytest.mark.parametrize("size, per_rank, mask_kind", [(2, 4, "documents"), (3, 4, "documents"), (2, 4, "causal"),
                                                       (3, 2, "window"), (2, 8, "documents")])
def test_ring_attention_under_any_chunk_assignment_equals_whole_attention(size, per_rank, mask_kind, monkeypatch):
    batch, heads, kv_heads, width, length = 2, 4, 2, 6, 48
    torch.manual_seed(0)
    q = torch.randn(batch, heads, length, width, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, length, width, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(batch, heads, length, width, dtype=torch.float64)
    positions = torch.arange(length)
    mask = {"documents": _block_diagonal(document_ids(_positions([[5, 20, 3, 20], [30, 18]]))),
            "causal": None,
            "window": (positions[:, None] >= positions[None, :]) & (positions[:, None] - positions[None, :] < 5)}[mask_kind]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    (expected * weight).sum().backward()
    assignment = _assignment(size, per_rank, seed=size + per_rank)
    assert assignment != head_tail(size)

    def work(rank, group):
        layout = SequenceLayout(length, size, rank, assignment)
        local = [split_sequence(t.detach(), layout, 2).requires_grad_() for t in (q, k, v)]
        rows = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).index_select(
            -2, layout.positions())
        out = ring_attention(*local, group, is_causal=mask is None, enable_gqa=True, attn_mask=rows, rank=rank,
                             size=size, assignment=assignment)
        (out * split_sequence(weight, layout, 2)).sum().backward()
        return layout, out.detach(), [t.grad for t in local]

    for layout, out, grads in run_ranks(size, work, monkeypatch):
        torch.testing.assert_close(out, split_sequence(expected.detach(), layout, 2), rtol=1e-10, atol=1e-12)
        for grad, whole in zip(grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(grad, split_sequence(whole, layout, 2), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("size, per_rank", [(2, 4), (3, 4)])
def test_cumsum_and_diff_along_the_sequence_are_global_under_any_chunk_assignment(size, per_rank):
    from lightning_parallel.parallelize.context.ops import chunk_cumsum, chunk_last, chunk_offsets, diff_after, order_chunks

    assignment = _assignment(size, per_rank, seed=1)
    length = 4 * size * per_rank
    layouts = [SequenceLayout(length, size, rank, assignment) for rank in range(size)]
    mask = torch.randint(0, 2, (2, length))
    parts = [chunk_cumsum(split_sequence(mask, layout), 1, parts=per_rank) for layout in layouts]
    totals = torch.stack([part[1] for part in parts])
    for layout, (sums, _) in zip(layouts, parts):
        local = (sums + chunk_offsets(order_chunks(totals, layout, 1), layout, 1).unsqueeze(2)).flatten(1, 2)
        assert torch.equal(local, split_sequence(mask.cumsum(1), layout))
    positions = _positions([[5, length - 5], [length - 7, 7]])
    lasts = torch.stack([chunk_last(split_sequence(positions, layout), 1, per_rank) for layout in layouts])
    for layout in layouts:
        local = diff_after(split_sequence(positions, layout), order_chunks(lasts, layout, 1), layout,
                           positions[:, :1] - 1, 1)
        assert torch.equal(local, split_sequence(torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1), layout))


def test_a_bad_assignment_is_refused_naming_it():
    with pytest.raises(ValueError, match="each chunk once"):
        SequenceLayout(16, 2, 0, ((0, 1), (1, 3)))
    with pytest.raises(ValueError, match="same number of chunks"):
        SequenceLayout(16, 2, 0, ((0, 1, 2), (3, 4, 5)))  # 16 does not cut into 6 equal chunks


@pytest.mark.parametrize("rows, per_rank", [([[7, 7, 1, 1], [9, 7]], 4)])  # 2 per rank re-paired: test_context_masked_models
def test_packed_documents_train_exactly_on_the_balanced_layout(rows, per_rank, monkeypatch):
    """transformers' Llama finds the documents from the restarting position_ids; the splitter lays the chunks out by
    their work (2 chunks per rank re-paired, or 4 per rank); logits and averaged gradients equal one device's."""
    from tests.unit.test_context_masked_models import BATCH, LENGTH, _compare, _llama, _tokens

    position_ids = _positions(rows)
    assert position_ids.shape == (BATCH, LENGTH)
    assignment, _ = assignment_for(position_ids, 2)
    assert assignment != head_tail(2) and len(assignment[0]) == per_rank
    seen = []
    original = SequenceLayout.__post_init__

    def record(layout):
        original(layout)
        seen.append(layout.assignment)

    monkeypatch.setattr(SequenceLayout, "__post_init__", record)
    torch.manual_seed(0)
    x, y = _tokens(2)
    _compare(_llama(), {"input_ids": x, "position_ids": position_ids, "use_cache": False}, y, 2, monkeypatch)
    assert assignment in seen  # the model calls ran on the balanced layout


@pytest.mark.parametrize("size", [2, 4])
def test_the_recipe_gpt_on_packed_documents_is_exact_on_the_balanced_layout(size, monkeypatch):
    """The recipe's data with pack_documents=true (position_ids restarting after blank lines) and the recipe GPT's
    document mask built in its forward from them: split over simulated cp ranks on the chosen layout, its logits
    and averaged gradients equal one device's (two steps' worth of backward, float64)."""
    import copy

    from recipes.data.chars import BlockDataset, encode_ascii
    from recipes.models.gpt import GPT

    text = "def a():\n    return 1\n\n\nclass B:\n    x = 2\n\nprint(a())\n\n" * 4
    data = BlockDataset(encode_ascii(text), 32, pack_documents=True)
    x, y, position_ids = (torch.stack(parts) for parts in zip(data[0], data[1]))
    assert int((position_ids == 0).sum()) > 2  # documents start inside the blocks
    chosen = assignment_for(position_ids, size)
    assert chosen is not None and chosen[0] != head_tail(size)  # the documents move the chunks off head-tail
    torch.manual_seed(0)
    model = GPT(128, 32, n_layer=2, n_head=2, n_embd=16, dropout=0.0, tie_weights=True).double()
    whole = copy.deepcopy(model)
    expected = []
    for _ in range(2):
        logits = whole(x, position_ids=position_ids)
        F.cross_entropy(logits.reshape(-1, 128), y.reshape(-1)).backward()
        expected.append(logits.detach())

    def work(rank, group):
        from lightning_parallel.parallelize.context.splitter import SequenceSplitter

        replica = copy.deepcopy(model)
        splitter = SequenceSplitter(replica, group, rank, size)
        try:
            seen = []
            for _ in range(2):
                logits = replica(x, position_ids=position_ids)
                F.cross_entropy(logits.reshape(-1, 128), y.reshape(-1)).backward()
                seen.append(logits.detach())
            return seen, {n: p.grad for n, p in replica.named_parameters()}
        finally:
            splitter.remove()

    results = run_ranks(size, work, monkeypatch)
    for seen, _ in results:
        for got, want in zip(seen, expected):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    for name, parameter in whole.named_parameters():
        averaged = torch.stack([grads[name] for _, grads in results]).mean(0)
        torch.testing.assert_close(averaged, parameter.grad, rtol=1e-8, atol=1e-10, msg=name)


def test_positions_given_to_a_pipelined_model_call_are_refused_naming_the_fix():
    from lightning_parallel.parallelize.context.traced import StageSequenceSplit

    split = StageSequenceSplit(None, 0, 2)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    refused = "got position_ids.*Set pipeline_parallel_size=1"
    with pytest.raises(ValueError, match=refused):
        split.split((tokens,), {"position_ids": _positions([[3, 5], [8]])})
    # Positions that do not restart in this batch are refused too: the recipe GPT indexes its position table with
    # them (seen at cp2 x pp2: an embedding out of bounds), and the next batch may restart them.
    with pytest.raises(ValueError, match=refused):
        split.split((tokens,), {"position_ids": torch.arange(8).expand(2, 8)})

    def forward(idx, position_ids=None):  # by position, named by the module's signature
        return idx

    with pytest.raises(ValueError, match=refused):
        split.split((tokens, torch.arange(8).expand(2, 8)), {}, forward)
    layout, (local,), _ = split.split((tokens,), {}, forward)  # the model builds its own positions: runs
    assert tuple(local.shape) == (2, 4) and layout.local_length == 4
