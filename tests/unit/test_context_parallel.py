"""Context parallelism without processes: the head-tail layout, positions made global, and the refusals.

The mode's position rewrites and every refusal happen before any collective, so they run here on a layout of
several ranks without a process group; what needs the ring runs on a one-rank gloo group.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import lightning_parallel
from lightning_parallel.parallelize.context.sequence import SequenceLayout, check_sequence_length
from lightning_parallel.parallelize.context.splitter import ContextParallelMode, SequenceSplitter


def test_head_tail_layout_gives_each_rank_a_head_and_a_tail_chunk():
    assert SequenceLayout(8, 2, 0).positions().tolist() == [0, 1, 6, 7]
    assert SequenceLayout(8, 2, 1).positions().tolist() == [2, 3, 4, 5]
    assert SequenceLayout(8, 4, 3).positions().tolist() == [3, 4]
    layout = SequenceLayout(12, 3, 0)
    concatenated = torch.cat([layout.positions_of(r) for r in range(3)])
    # global_order undoes the concatenation of the ranks' slices.
    assert concatenated[layout.global_order()].tolist() == list(range(12))


def test_sequence_length_not_divisible_by_twice_cp_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2 × context_parallel_size = 4.*multiple of 4"):
        check_sequence_length(6, 2)
    check_sequence_length(8, 4)


def test_positions_built_from_the_local_length_become_global():
    table = torch.arange(16.0).unsqueeze(1).repeat(1, 3)  # a rotary-like table: row i holds i
    other = torch.arange(16.0)
    with ContextParallelMode(SequenceLayout(8, 2, 1), group=None, module_tensors={id(table)}):
        assert torch.arange(4).tolist() == [2, 3, 4, 5]
        assert torch.arange(0, 4, dtype=torch.float64).tolist() == [2.0, 3.0, 4.0, 5.0]
        assert torch.arange(10, 14).tolist() == [12, 13, 14, 15]  # HF's cache_position after past tokens
        assert torch.arange(3).tolist() == [0, 1, 2]  # another length: left alone
        assert table[:4][:, 0].tolist() == [2, 3, 4, 5]
        assert table[:4, :][:, 1].tolist() == [2, 3, 4, 5]
        assert other[:4].tolist() == [0, 1, 2, 3]  # not the module's tensor: left alone
    short = torch.zeros(6, 2)
    with ContextParallelMode(SequenceLayout(8, 2, 0), group=None, module_tensors={id(short)}), \
            pytest.raises(IndexError, match="shorter than the sequence"):
        short[:4]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"attn_mask": torch.eye(4, dtype=torch.bool)}, TypeError, "attn_mask .*neither the causal mask"),
        ({"dropout_p": 0.1}, ValueError, "dropout_p=0.1"),
    ],
)
def test_attention_the_ring_cannot_run_is_refused(kwargs, error, match):
    q = torch.randn(1, 2, 4, 8)
    with ContextParallelMode(SequenceLayout(8, 2, 0), group=None, module_tensors=set()):
        with pytest.raises(error, match=match):
            F.scaled_dot_product_attention(q, q, q, **kwargs)
        with pytest.raises(TypeError, match="query length 4 and key length 8"):
            F.scaled_dot_product_attention(q, torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))


class HandWrittenAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        # Attention in einsum, neither SDPA nor matrix products (which context parallelism takes over every key)
        weights = torch.einsum("bqd,bkd->bqk", h, h).softmax(-1)
        return torch.einsum("bqk,bkd->bqd", weights, h)


def test_model_without_sdpa_is_refused_before_any_collective():
    splitter = SequenceSplitter(HandWrittenAttention(), group=None, rank=0, size=2)
    with pytest.raises(RuntimeError, match="no F.scaled_dot_product_attention call"):
        splitter.root(torch.randn(2, 8, 8))


def test_batchnorm_is_refused_when_the_splitter_is_set_up():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    with pytest.raises(ValueError, match=r"BatchNorm layers \(1\).*this rank's part of each sequence"):
        SequenceSplitter(model, group=None, rank=0, size=2)


def test_sequence_length_is_checked_at_the_model_call():
    splitter = SequenceSplitter(HandWrittenAttention(), group=None, rank=0, size=2)
    with pytest.raises(ValueError, match="sequence length 6"):
        splitter.root(torch.randn(2, 6, 8))


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_hugging_face_loss_from_labels_is_refused(one_rank_group):
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import build_config

    model = transformers.AutoModelForCausalLM.from_config(build_config("llama", attention="sdpa")).double()
    splitter = SequenceSplitter(model, one_rank_group, rank=0, size=1)
    tokens = torch.randint(0, 128, (2, 8))
    assert splitter.root(input_ids=tokens).logits.shape == (2, 8, 128)
    with pytest.raises(TypeError, match=r"tensor of shape \(\) .*compute the loss in the step"):
        splitter.root(input_ids=tokens, labels=tokens)


def test_checkpointing_inside_the_model_is_refused(one_rank_group):
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import build_config

    model = transformers.AutoModelForCausalLM.from_config(build_config("llama", attention="sdpa")).double()
    model.gradient_checkpointing_enable()
    model.train()
    splitter = SequenceSplitter(model, one_rank_group, rank=0, size=1)
    with pytest.raises(RuntimeError, match="activation checkpointing that the model applies itself"):
        splitter.root(input_ids=torch.randint(0, 128, (2, 8)))


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"compile": True}, "compile=True"),
        ({"sync": "local_sgd", "sync_every": 2}, "sync='local_sgd'"),
    ],
)
def test_combinations_not_supported_yet_are_refused_before_launch(options, match):
    strategy = lightning_parallel.HybridParallelStrategy(data_parallel_size=-1, context_parallel_size=2, **options)
    with pytest.raises(ValueError, match=f"context_parallel_size=2 does not combine with {match}"):
        L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)


# --- ops along the sequence (parallelize/context/ops.py) ---------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3])
def test_cumsum_over_the_split_sequence_is_global_on_every_simulated_rank(size):
    from lightning_parallel.parallelize.context.sequence import split_sequence
    from lightning_parallel.parallelize.context.ops import (
        chunk_cumsum,
        chunk_last,
        chunk_offsets,
        diff_after,
        order_chunks,
    )

    mask = torch.randint(0, 2, (2, 12 * size))  # attention_mask / input_ids.ne(pad): position ids by cumsum
    layouts = [SequenceLayout(mask.size(1), size, rank) for rank in range(size)]
    parts = [chunk_cumsum(split_sequence(mask, layout), 1) for layout in layouts]
    totals = torch.stack([part[1] for part in parts])  # what the all-gather hands every rank
    for layout, (sums, _) in zip(layouts, parts):
        local = (sums + chunk_offsets(order_chunks(totals, layout, 1), layout, 1).unsqueeze(2)).flatten(1, 2)
        assert torch.equal(local, split_sequence(mask.cumsum(1), layout))
    # diff(position_ids, prepend=first - 1): Hugging Face's packed-sequence check, one reset at position 5.
    positions = torch.cat([torch.arange(5), torch.arange(12 * size - 5)]).expand(2, -1)
    lasts = torch.stack([chunk_last(split_sequence(positions, layout), 1) for layout in layouts])
    for layout in layouts:
        local = diff_after(split_sequence(positions, layout), order_chunks(lasts, layout, 1), layout,
                           split_sequence(positions, layout)[:, :1] - 1, 1)
        assert torch.equal(local, split_sequence(torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1), layout))


def test_cumsum_in_the_mode_is_global_and_other_sequence_ops_are_refused(one_rank_group):
    # One rank holds the whole sequence as head and tail: the chunk offsets still have to be right.
    layout = SequenceLayout(8, 1, 0)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1]])
    names = {}
    conv = torch.nn.Conv1d(3, 3, kernel_size=2, padding=1)
    names[id(conv)] = "mixer.conv1d"
    with ContextParallelMode(layout, one_rank_group, module_tensors=set(), module_names=names):
        assert torch.equal(torch.cumsum(mask, dim=1), mask.cumsum(-1))
        assert mask.cumsum(dim=1).tolist() == [[1, 2, 2, 3, 4, 5, 5, 6]]
        assert torch.cumsum(mask.bool(), 1).dtype == torch.int64
        assert torch.cumsum(torch.ones(2, 3), 0).tolist() == [[1, 1, 1], [2, 2, 2]]  # not along the sequence
        assert torch.ones(8, 3).cumsum(0)[-1].tolist() == [8, 8, 8]  # dim 0: batch, or tokens flattened across rows
        conv1d_refused = r"mixer.conv1d \(Conv1d\) calls conv1d on a tensor of shape \(1, 3, 8\)"
        with pytest.raises(NotImplementedError, match=conv1d_refused):
            conv(torch.randn(1, 3, 8))
        with pytest.raises(NotImplementedError, match="calls cumprod"):
            torch.randn(2, 8).cumprod(1)
        positions = torch.arange(8).unsqueeze(0)
        assert torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1).tolist() == [[1] * 8]
        with pytest.raises(NotImplementedError, match="calls diff"):
            torch.diff(positions)  # the global result is one shorter: no even split
        with pytest.raises(NotImplementedError, match="calls flip"):
            torch.flip(torch.randn(2, 8, 3), dims=(1,))
        with pytest.raises(NotImplementedError, match="calls cumsum.*along dim 2"):
            torch.randn(2, 4, 8).cumsum(-1)
        with pytest.raises(NotImplementedError, match="calls cumsum.*needs gradients"):
            torch.randn(2, 8, requires_grad=True).cumsum(1)


def _causal(positions):
    return positions.unsqueeze(1) >= positions.unsqueeze(0)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_materialised_causal_mask_runs_as_is_causal_and_other_masks_are_refused(rank):
    from lightning_parallel.parallelize.context.ops import mask_as_causal

    layout = SequenceLayout(8, 2, rank)
    positions = layout.positions()
    causal = _causal(positions)
    assert mask_as_causal(causal.expand(3, 1, 4, 4), layout, group=None) is True
    additive = torch.zeros(4, 4, dtype=torch.float64).masked_fill(~causal, torch.finfo(torch.float64).min)
    assert mask_as_causal(additive, layout, group=None) is True
    assert mask_as_causal(torch.ones(2, 1, 4, 4, dtype=torch.bool), layout, group=None) is None  # padding mask of ones
    window = causal & (positions.unsqueeze(1) - positions.unsqueeze(0) < 2)  # sliding window of 2 < sequence of 8
    padded = causal.clone()
    padded[:, 0] = False  # a padded key
    for mask in (window, padded):
        with pytest.raises(TypeError, match="neither the causal mask nor all-allowing: it blocks query position"):
            mask_as_causal(mask, layout, group=None)
    with pytest.raises(TypeError, match="lets query position .* attend to the later key position"):
        mask_as_causal(torch.ones(4, 4, dtype=torch.bool).tril(1), layout, group=None)
    with pytest.raises(TypeError, match="adds -0.5 to the score: an attention bias"):
        mask_as_causal(additive.masked_fill(causal, -0.5), layout, group=None)
    with pytest.raises(TypeError, match=r"attn_mask of shape \(8, 8\)"):
        mask_as_causal(torch.ones(8, 8, dtype=torch.bool), layout, group=None)


def test_ring_attention_with_narrower_values_than_queries_and_keys(one_rank_group):
    # Multi-head latent attention (DeepSeek-V2/V3): v's head width differs from q/k's.
    from lightning_parallel.parallelize.context.ring_attention import ring_attention

    torch.manual_seed(0)
    for v_width in (3, 12):
        q, k = (torch.randn(2, 2, 8, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 2, 8, v_width, dtype=torch.float64, requires_grad=True)
        out = ring_attention(q, k, v, one_rank_group, is_causal=True)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        for grad, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v))):
            torch.testing.assert_close(grad, want)


def test_ring_attention_broadcasts_one_key_value_head_without_enable_gqa(one_rank_group):
    # Falcon's multi-query attention calls SDPA with one key/value head and no enable_gqa: SDPA broadcasts it.
    from lightning_parallel.parallelize.context.ring_attention import ring_attention

    q = torch.randn(2, 4, 8, 6, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 8, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = ring_attention(q, k, v, one_rank_group, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    for grad, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(grad, want)
    with pytest.raises(ValueError, match="4 query heads and 2 key/value heads without enable_gqa"):
        ring_attention(q, torch.randn(2, 2, 8, 6), torch.randn(2, 2, 8, 6), one_rank_group)


def test_ring_attention_under_autocast_casts_its_inputs_as_sdpa_does(one_rank_group):
    # bf16-mixed: Llama's rotary embedding leaves query and key in float32 beside a bfloat16 value, and SDPA's autocast
    # casts all three to bfloat16; the ring calls the fused kernels directly, which autocast does not reach.
    from lightning_parallel.parallelize.context.ring_attention import ring_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 6, requires_grad=True)
    k = torch.randn(2, 2, 8, 6, requires_grad=True)
    v = torch.randn(2, 2, 8, 6, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(q, k, v, one_rank_group, is_causal=True, enable_gqa=True)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    for grad, want, leaf in zip(grads, torch.autograd.grad(expected.float().square().sum(), (q, k, v)), (q, k, v)):
        assert grad.dtype == leaf.dtype
        torch.testing.assert_close(grad, want, rtol=2e-2, atol=2e-2)
    # Autocast never casts float64: a float64 model under autocast keeps its exact ring.
    q64, k64, v64 = (t.detach().double() for t in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out64 = ring_attention(q64, k64, v64, one_rank_group, is_causal=True)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, F.scaled_dot_product_attention(q64, k64, v64, is_causal=True))


class ImageModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 8, kernel_size=4, stride=4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.patches(pixel_values).flatten(2).transpose(1, 2)


def test_image_model_call_is_refused_naming_the_input():
    splitter = SequenceSplitter(ImageModel(), group=None, rank=0, size=2)
    with pytest.raises(TypeError, match=r"pixel_values= of shape \(2, 3, 8, 8\).*not a token sequence"):
        splitter.root(pixel_values=torch.randn(2, 3, 8, 8))
    with pytest.raises(TypeError, match=r"its first tensor argument of shape \(2, 3, 8, 8\)"):
        splitter.root(torch.randn(2, 3, 8, 8))


def _tiny_hf_model(transformers, family):
    if family == "falcon":  # materialises the causal mask and calls SDPA with one key/value head
        config = transformers.FalconConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           multi_query=True, alibi=False, max_position_embeddings=16)
    else:  # Mistral with a sliding window of 8, shorter than the sequence of 16
        config = transformers.MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
                                            max_position_embeddings=16)
    config._attn_implementation = "sdpa"
    return transformers.AutoModel.from_config(config).double()


@pytest.mark.parametrize("family", ["falcon", "mistral"])
def test_hugging_face_masks_are_built_over_the_whole_sequence(monkeypatch, family):
    # Rank 0 of two (queries at global positions 0-3 and 12-15): transformers' mask builders run on the whole
    # sequence, and the ring gets rank 0's rows of the whole mask, over all 16 keys. Falcon materialises the plain
    # causal mask: the ring's plan is that of is_causal=True (no block needs the mask); Mistral's window of 8 is
    # shorter than the sequence of 16.
    transformers = pytest.importorskip("transformers")
    import lightning_parallel.parallelize.context.splitter as context

    model = _tiny_hf_model(transformers, family)
    calls = []

    def local_attention(query, key, value, group, is_causal=False, scale=None, enable_gqa=False, attn_mask=None,
                        plan=None, rank=None, size=None, softcap=None, sinks=None, assignment=None):
        calls.append((is_causal, None if attn_mask is None else tuple(attn_mask.shape), plan))
        return torch.zeros_like(query)  # no ring here: only what reaches it is checked

    from lightning_parallel.parallelize.context import hf_masks

    monkeypatch.setattr(context, "ring_attention", local_attention)
    layout = SequenceLayout(16, 2, 0)
    tokens = context.split_sequence(torch.randint(0, 32, (2, 16)), layout)
    sites = hf_masks.builder_sites(model)
    hf_masks.install(sites)
    try:
        with ContextParallelMode(layout, group=None, module_tensors=set()):
            model(input_ids=tokens)
    finally:
        hf_masks.uninstall(sites)
    (is_causal, shape, plan), = calls
    assert not is_causal and shape == (2, 1, 8, 16)
    if family == "falcon":
        from lightning_parallel.parallelize.context.ring_plan import plan_without_mask

        assert plan == plan_without_mask(0, 2, 8, is_causal=True)
    else:
        # Rank 0's head chunk (0-3) attends to keys 0-3 (causal within the chunk), its tail (12-15) causally to
        # itself and, against rank 1's keys (4-11), to 5-11 through the window: one masked call; its head rows skip
        # rank 1 entirely.
        assert [[(call.rows, call.chunks, call.kind) for call in step] for step in plan.steps] == [
            [(slice(0, 4), (0,), "causal"), (slice(4, 8), (1,), "causal")], [(slice(4, 8), (0, 1), "masked")]]


class _Drifting(torch.nn.Module):
    """Attention through SDPA, plus a term that changes at every call: the split call cannot match the whole one."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8, dtype=torch.float64)
        self.dropout = torch.nn.Dropout(0.5)
        self.calls = 0

    def forward(self, tokens):
        self.calls += 1
        x = self.dropout(self.embed(tokens)).unsqueeze(1)
        return F.scaled_dot_product_attention(x, x, x, is_causal=True).squeeze(1) + self.calls


def test_first_call_is_checked_against_the_whole_sequence_and_a_difference_is_refused(one_rank_group):
    module = _Drifting()
    SequenceSplitter(module, one_rank_group, rank=0, size=1)
    tokens = torch.randint(0, 16, (2, 8))
    state = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"computes something else under context parallelism .*relative difference"):
        module(tokens)
    # The check ran the model twice (whole, then split) without gradients, in eval mode, drawing no random numbers.
    assert module.calls == 2 and module.training and module.dropout.training
    assert torch.equal(torch.random.get_rng_state(), state)


def test_the_check_runs_once_and_a_matching_model_trains_unchanged(one_rank_group):
    module = _Drifting()
    module.calls = -10**12  # the drift is negligible at this size: the check passes
    splitter = SequenceSplitter(module, one_rank_group, rank=0, size=1)
    tokens = torch.randint(0, 16, (2, 8))
    module(tokens)
    assert splitter.checked and module.calls == -10**12 + 3  # whole, split, then the real call
    module(tokens)
    assert module.calls == -10**12 + 4
