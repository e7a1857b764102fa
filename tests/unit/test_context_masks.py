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


# --- the model's mask in the ring's form (parallelize/context/masks.py) -------------------------------------------


def test_masks_reach_the_ring_as_this_ranks_rows_of_every_key(monkeypatch):
    from lightning_parallel.parallelize.context.masks import ring_mask

    length, size = 8, 2
    whole = torch.rand(2, 1, length, length) > 0.3
    keep = torch.rand(2, length) > 0.3

    def work(rank, group):
        layout = SequenceLayout(length, size, rank)
        positions = layout.positions()
        rows_of_whole, _ = ring_mask(whole, layout, group)  # [B, 1, L, L]: this rank's rows
        split_rows, _ = ring_mask(whole.squeeze(1).index_select(1, positions), layout, group)  # [B, L, L] split by rows
        # A key padding mask built inside the model from the split attention_mask: the columns are gathered.
        keys, _ = ring_mask(split_sequence(keep, layout)[:, None, None, :], layout, group)
        return rows_of_whole, split_rows, keys, positions

    for rows_of_whole, split_rows, keys, positions in run_ranks(size, work, monkeypatch):
        assert torch.equal(rows_of_whole, whole[:, :, positions])
        assert torch.equal(split_rows, whole[:, 0, positions].unsqueeze(0))
        assert torch.equal(keys, keep[:, None, None, :])


def test_a_mask_of_this_ranks_block_only_is_refused_with_the_fix_unless_causal():
    from lightning_parallel.parallelize.context.masks import ring_mask

    layout = SequenceLayout(8, 2, 1)
    positions = layout.positions()
    causal = positions[:, None] >= positions[None, :]
    assert ring_mask(causal, layout, None) == (None, True)
    assert ring_mask(torch.ones(4, 4, dtype=torch.bool), layout, None) == (None, False)
    documents = causal & (positions[:, None] // 3 == positions[None, :] // 3)
    with pytest.raises(TypeError, match=r"covers this rank's 4 queries × its own 4 keys only.*\[batch, 1, 8, 8\]"):
        ring_mask(documents, layout, None)
    with pytest.raises(TypeError, match=r"attn_mask of shape \(1, 1, 4, 6\)"):
        ring_mask(torch.ones(4, 6, dtype=torch.bool), layout, None)


def test_a_model_that_adjusts_the_whole_mask_from_its_part_is_refused_naming_it():
    from lightning_parallel.parallelize.context.splitter import ContextParallelMode

    layout = SequenceLayout(8, 2, 0)
    whole_mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    per_key = torch.rand(2, 4, 4, 4) > 0.5  # computed from this rank's keys (Doge's dynamic mask)
    with ContextParallelMode(layout, group=None, module_tensors=set()):
        with pytest.raises(ValueError, match=r"combines an attention mask over the whole sequence .*\(2, 4, 4, 4\)"):
            whole_mask[..., :4] & per_key


def test_index_based_mask_functions_run_on_the_whole_sequence_and_others_on_this_ranks_part():
    from lightning_parallel.parallelize.context.hf_masks import _index_based

    window = 3
    assert _index_based(lambda b, h, q, kv: q - kv < window, 4)
    assert _index_based(lambda *args: torch.tensor(True), 4)
    token_types = torch.zeros(2, 4)
    assert not _index_based(lambda b, h, q, kv: token_types[b, kv] == 0, 4)


def test_masks_built_from_this_ranks_part_are_followed_over_the_whole_sequence():
    from lightning_parallel.parallelize.context.splitter import ContextParallelMode

    layout = SequenceLayout(8, 2, 1)  # positions 2-5
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    part = split_sequence(documents, layout)
    slopes = torch.tensor([0.5, 0.25]).view(2, 1, 1)
    with ContextParallelMode(layout, group=None, module_tensors=set(), whole_inputs=[(part, documents)]) as mode:
        positions = torch.arange(4)
        same = part[:, :, None] == part[:, None, :]
        mask = same & (positions[:, None] >= positions[None, :])
        alibi = -(positions[:, None] - positions[None, :]).abs() * slopes
        written = mask.clone()
        written[:, 0, 0] = False  # an in-place write: its whole is no longer known
        activations = torch.randn(1, 4, 4, requires_grad=True)
        mixed = activations + mask  # an activation: never followed
    whole_positions = torch.arange(8)
    causal = whole_positions[:, None] >= whole_positions[None, :]
    assert torch.equal(mode.whole.of(mask), (documents[:, :, None] == documents[:, None, :]) & causal)
    assert torch.equal(mode.whole.of(alibi), -(whole_positions[:, None] - whole_positions[None, :]).abs() * slopes)
    assert mode.whole.of(written) is None and mode.whole.of(mixed) is None
