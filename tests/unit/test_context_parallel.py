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
from lightning_parallel.parallelize.context import (
    ContextParallelMode,
    SequenceLayout,
    SequenceSplitter,
    check_sequence_length,
)


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
        ({"attn_mask": torch.ones(4, 4, dtype=torch.bool)}, TypeError, "attn_mask"),
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
        weights = (h @ h.transpose(1, 2)).softmax(-1)  # attention without SDPA
        return weights @ h


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
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"sequence_parallel": True, "tensor_parallel_size": 2}, "sequence_parallel=True"),
        ({"compile": True}, "compile=True"),
        ({"sync": "local_sgd", "sync_every": 2}, "sync='local_sgd'"),
    ],
)
def test_combinations_not_supported_yet_are_refused_before_launch(options, match):
    strategy = lightning_parallel.HybridParallelStrategy(data_parallel_size=-1, context_parallel_size=2, **options)
    with pytest.raises(ValueError, match=f"context_parallel_size=2 does not combine with {match}"):
        L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
