"""Pipeline replicas' gradient reduction: one all-reduce per bucket, so the count follows the bytes, not the
parameters (the all-reduce is stood in for by two replicas holding the same gradients: a sum doubles them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.data import grad_sync


@pytest.fixture
def all_reduces(monkeypatch):
    sizes: list[int] = []

    class Doubling:
        @staticmethod
        def all_reduce(tensor, op=None, group=None):
            sizes.append(tensor.numel())
            return tensor.mul_(2)

    monkeypatch.setattr(grad_sync, "collectives", Doubling)
    return sizes


def _grads(count: int, numel: int) -> list[torch.Tensor]:
    return [torch.arange(numel, dtype=torch.float64) + i for i in range(count)]


@pytest.mark.parametrize("count", [4, 64])
def test_all_reduces_follow_bytes_not_parameters(count, all_reduces):
    grads = _grads(count, 4096 // count)  # 4096 float64 values in all: 32 KiB
    expected = [g.clone() for g in grads]
    sent = grad_sync.all_reduce_flat(grads, None, torch.distributed.ReduceOp.SUM, divide_by=2, bucket_bytes=8 * 1024)
    assert len(all_reduces) == 4  # 32 KiB in buckets of 8 KiB, whether in 4 or 64 gradients
    assert sent == 4096 * 8
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # summed over two equal replicas, divided by two


def test_a_gradient_larger_than_a_bucket_is_reduced_in_place(all_reduces):
    big = torch.ones(1000, 3, dtype=torch.float64)
    small = [torch.ones(10, dtype=torch.float64), torch.ones(10, dtype=torch.float32), torch.ones(5, dtype=torch.float64)]
    pointer = big.data_ptr()
    grad_sync.all_reduce_flat([small[0], big, small[1], small[2]], None, torch.distributed.ReduceOp.SUM, divide_by=1, bucket_bytes=1024)
    # float64: [small0] then [big] (alone, in place) then [small2]; float32: [small1].
    assert sorted(all_reduces) == sorted([10, 3000, 5, 10]) and big.data_ptr() == pointer
    assert all(bool((t == 2).all()) for t in [big, *small])


def test_sum_gradients_gives_a_missing_gradient_zeros(all_reduces):
    weight = nn.Parameter(torch.ones(3, dtype=torch.float64))
    grad_sync.sum_gradients([weight], None)
    assert weight.grad is not None and bool((weight.grad == 0).all()) and all_reduces == [3]
