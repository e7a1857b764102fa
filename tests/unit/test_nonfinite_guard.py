"""The non-finite guard on simulated ranks: one collective and one host read per step whatever the number of
gradients, the same decision on every rank, and the culprits read back from the flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_parallel import collectives
from lightning_parallel.strategies.components import nonfinite
from lightning_parallel.strategies.components.nonfinite import NonFiniteGuard


def engine(plugin=None) -> SimpleNamespace:
    trainer = SimpleNamespace(global_step=3)
    return SimpleNamespace(root_device=torch.device("cpu"), precision_plugin=plugin or Precision(),
                           lightning_module=SimpleNamespace(trainer=trainer))


def optimizer_with(grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    params = [nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in grads]
    for param, grad in zip(params, grads):
        param.grad = grad
    return torch.optim.SGD(params, lr=0.1)


@pytest.fixture
def real_values(monkeypatch):
    """LocalTensorMode computes real values over the fake group, which the guard otherwise takes for a dry run's."""
    monkeypatch.setattr(nonfinite, "is_dry_run", lambda: False)


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gradients", [2, 64])
def test_one_collective_and_one_host_read_per_step(fake_world, monkeypatch, gradients):
    calls = {"collectives": 0, "host reads": 0}
    all_reduce, tolist = collectives.all_reduce, torch.Tensor.tolist

    def counted_all_reduce(*args, **kwargs):
        calls["collectives"] += 1
        return all_reduce(*args, **kwargs)

    def counted_tolist(self):
        calls["host reads"] += 1
        return tolist(self)

    def refused(self, *args):
        raise AssertionError("a host read per tensor")

    monkeypatch.setattr(collectives, "all_reduce", counted_all_reduce)
    monkeypatch.setattr(dist, "all_gather", refused)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    for name in ("item", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refused)
    guard = NonFiniteGuard(engine(), "error")
    grads = [torch.randn(3, 5) for _ in range(gradients)]
    assert guard._check(torch.tensor(1.5), optimizer_with(grads)) is False
    assert calls == {"collectives": 1, "host reads": 1}


def test_a_gradient_non_finite_on_one_rank_stops_every_rank(simulated_ranks, real_values):
    from torch.distributed._local_tensor import LocalTensor

    # Each rank's values are built outside the simulation (inside it, every new tensor is already one per rank).
    grad = LocalTensor({0: torch.ones(4), 1: torch.tensor([1.0, float("inf"), 2.0, 3.0])})
    loss = LocalTensor({0: torch.tensor(0.5), 1: torch.tensor(0.5)})
    with simulated_ranks():
        optimizer = optimizer_with([torch.ones(2, 2), grad])
        with pytest.raises(RuntimeError, match=r"at optimizer step 3: gradients on rank\(s\)"):
            NonFiniteGuard(engine(), "error")._check(loss, optimizer)


def test_skip_drops_every_gradient_on_every_rank(simulated_ranks, real_values):
    from torch.distributed._local_tensor import LocalTensor

    loss = LocalTensor({0: torch.tensor(0.5), 1: torch.tensor(float("nan"))})
    with simulated_ranks():
        optimizer = optimizer_with([torch.ones(2, 2), torch.ones(3)])
        guard = NonFiniteGuard(engine(), "skip")
        with pytest.warns(UserWarning, match="skipped optimizer step 3 on every rank: non-finite loss"):
            assert guard._check(loss, optimizer) is True
    assert guard.skipped_steps == 1
    assert all(p.grad is None for group in optimizer.param_groups for p in group["params"])


def test_finite_values_and_empty_shards_pass():
    guard = NonFiniteGuard(engine(), "error")
    grads = [torch.randn(3).bfloat16(), torch.empty(0), torch.full((2,), 3e38)]  # huge but finite: no overflow
    assert guard._check(torch.tensor(2.0), optimizer_with(grads)) is False


def test_culprits_are_read_from_the_ranks_columns():
    assert nonfinite._culprits([[0, 1, 0, 1], [1, 0, 0, 0]]) == {"loss": [1, 3], "gradients": [0]}
