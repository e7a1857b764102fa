"""Ring attention with masks, on simulated context-parallel ranks (threads): every mask SDPA takes, exact.

Each rank holds its head-tail part of the queries, keys and values and this rank's rows of the whole sequence's
mask; its output rows and its gradients (queries, and its keys and values after the all-to-all) must equal the
whole sequence's SDPA in float64. The plans' skipped blocks are checked against what each mask allows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.parallelize.context.ring_attention import ring_attention
from lightning_parallel.parallelize.context.ring_plan import CAUSAL, FULL, MASKED, SKIP, plan_for_mask, plan_without_mask
from lightning_parallel.parallelize.context.sequence import SequenceLayout, split_sequence
from tests.unit.cp_simulated import run_ranks

B, HEADS, KV_HEADS, D = 2, 4, 2, 6


def _documents(lengths: list[int]) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ids


def masks(length: int) -> dict[str, torch.Tensor | None]:
    positions = torch.arange(length)
    causal = positions[:, None] >= positions[None, :]
    docs = _documents([3, length - 8, 5])
    block_diagonal = causal & (docs[:, None] == docs[None, :])
    window = causal & (positions[:, None] - positions[None, :] < 3)
    keep = torch.ones(B, length, dtype=torch.bool)
    keep[0, -5:] = False  # right padding
    keep[1, :4] = False  # left padding: the first queries see no key at all
    padded = causal & keep[:, None, None, :]
    bias = torch.randn(1, HEADS, length, length, dtype=torch.float64)
    alibi = -(positions[:, None] - positions[None, :]).abs().double() * torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(HEADS, 1, 1)
    additive = torch.zeros(length, length, dtype=torch.float64).masked_fill(~block_diagonal, torch.finfo(torch.float64).min)
    return {
        "causal": None, "none": None, "block_diagonal": block_diagonal, "sliding_window": window, "padding": padded,
        "key_padding_bidirectional": keep[:, None, None, :], "bias": bias, "alibi_causal": alibi.masked_fill(~causal, float("-inf")),
        "additive_min": additive, "everything_dropped_for_some_rows": block_diagonal & (positions >= 2)[None, :],
    }


def _run(size: int, length: int, name: str, monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(B, HEADS, length, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, KV_HEADS, length, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(B, HEADS, length, D, dtype=torch.float64)
    mask = masks(length)[name]
    is_causal = name == "causal"
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    (expected * weight).sum().backward()

    def work(rank, group):
        layout = SequenceLayout(length, size, rank)
        positions = layout.positions()
        local = [split_sequence(t.detach(), layout, 2).requires_grad_() for t in (q, k, v)]
        rows = None
        if mask is not None:
            m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            rows = m if m.size(-2) == 1 else m.index_select(-2, positions)
        out = ring_attention(*local, group, is_causal=is_causal, enable_gqa=True, attn_mask=rows, rank=rank, size=size)
        (out * split_sequence(weight, layout, 2)).sum().backward()
        return layout, out.detach(), [t.grad for t in local]

    for layout, out, grads in run_ranks(size, work, monkeypatch):
        torch.testing.assert_close(out, split_sequence(expected.detach(), layout, 2), rtol=1e-10, atol=1e-12)
        for grad, whole in zip(grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(grad, split_sequence(whole, layout, 2), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(masks(16)))
def test_ring_with_any_mask_equals_whole_attention_on_two_ranks(name, monkeypatch):
    _run(2, 16, name, monkeypatch)


@pytest.mark.parametrize("name", ["causal", "block_diagonal", "padding", "sliding_window"])
def test_ring_with_masks_on_three_ranks(name, monkeypatch):
    _run(3, 24, name, monkeypatch)
