"""Gradient clipping over tensor-parallel shards on 2 simulated ranks: the whole model's norm and torch's scaling,
with a number of collectives that does not grow with the model's depth and no host read of a value."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from lightning_parallel import collectives
from lightning_parallel.parallelize.common import grad_norm
from lightning_parallel.parallelize.common.grad_norm import clip_grad_norm_, total_grad_norm

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def model(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(layers))).double()


def backward(module: nn.Module) -> None:
    torch.manual_seed(1)
    out = module(torch.randn(4, WIDTH, dtype=torch.float64))
    (out * torch.linspace(-3, 3, WIDTH, dtype=torch.float64)).sum().backward()


def split(module: nn.Sequential) -> None:
    """Column-split ``up``, row-split ``down`` over tp=2; the norms stay whole (plain gradients beside DTensor ones)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(module)):
        plan |= {f"{i}.up": ColwiseParallel(), f"{i}.down": RowwiseParallel()}
    parallelize_module(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), plan)


def rank0(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return tensor._local_tensors[0] if hasattr(tensor, "_local_tensors") else tensor


@contextmanager
def counted(monkeypatch):
    """Count the library's all-reduces and fail on any read of a tensor's value into Python."""
    calls = {"all_reduce": 0}
    original = collectives.all_reduce

    def all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return original(*args, **kwargs)

    def host_read(self, *args, **kwargs):
        raise AssertionError("a host read of a tensor's value in the clipping path")

    with monkeypatch.context() as patch:
        patch.setattr(collectives, "all_reduce", all_reduce)
        for name in ("item", "tolist", "__bool__", "__float__"):
            patch.setattr(torch.Tensor, name, host_read)
        yield calls


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clipping_split_gradients_matches_torch_on_the_whole_model(simulated_ranks, norm_type):
    whole = model(2)
    backward(whole)
    expected_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.5, norm_type)
    assert expected_norm > 0.5, "the test must clip"
    module = model(2)
    with simulated_ranks():
        split(module)
        backward(module)
        norm = clip_grad_norm_(list(module.parameters()), 0.5, norm_type)
        grads = {name: rank0(p.grad) for name, p in module.named_parameters()}
    torch.testing.assert_close(rank0(norm), expected_norm, rtol=1e-12, atol=0)
    assert rank0(norm).dtype == torch.float64  # float64 gradients: float64 sums
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-15)


def test_collectives_and_host_reads_do_not_grow_with_depth(simulated_ranks, monkeypatch):
    counts = {}
    for layers in (2, 8):
        module = model(layers)
        with simulated_ranks():
            split(module)
            backward(module)
            with counted(monkeypatch) as calls:
                clip_grad_norm_(list(module.parameters()), 0.5)
        counts[layers] = calls["all_reduce"]
    # One all-reduce over tp for every split gradient together (the old code ran one per DTensor gradient: 2 x layers).
    assert counts == {2: 1, 8: 1}


def test_sum_over_and_divided_keep_their_meaning(simulated_ranks):
    """Ranks holding different parameters (``sum_over``) or different experts (``divided``): their shares add up."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensor

    def parameter(values: dict[int, list[float]]) -> nn.Parameter:
        param = nn.Parameter(torch.zeros(len(values[0]), dtype=torch.float64))
        param.grad = LocalTensor({rank: torch.tensor(v, dtype=torch.float64) for rank, v in values.items()})
        return param

    with simulated_ranks():
        world = dist.group.WORLD
        shared = parameter({0: [3.0, 0.0], 1: [3.0, 0.0]})  # the same on both ranks: counted once
        own = parameter({0: [4.0], 1: [12.0]})  # each rank's own: summed over the group
        summed = total_grad_norm([own], sum_over=world)
        divided = total_grad_norm([shared, own], divided=([own], world))
        peak = total_grad_norm([own], math.inf, sum_over=world)
    assert float(rank0(summed)) == pytest.approx(math.sqrt(16 + 144))
    assert float(rank0(divided)) == pytest.approx(math.sqrt(9 + 16 + 144))
    assert float(rank0(peak)) == 12.0


def test_low_precision_gradients_are_summed_in_float32():
    module = nn.Linear(4, 4).bfloat16()
    for p in module.parameters():
        p.grad = torch.full_like(p, 300.0)  # squares overflow nothing in float32; bfloat16 sums would round
    norm = total_grad_norm(module.parameters())
    assert norm.dtype == torch.float32
    assert float(norm) == pytest.approx(300.0 * math.sqrt(20), rel=1e-6)


def test_every_rank_sums_over_mesh_dimensions_in_one_order():
    """dp2 x tp2: tp groups named "15"/"16", dp groups "9"/"10". By group names alone rank 0 would sum over tp first
    and rank 1 over dp first, and rank 1 would add rank 0's term before rank 0 had summed it over dp."""

    class Group:
        def __init__(self, name: str) -> None:
            self.group_name = name

    tp = {0: Group("15"), 1: Group("15"), 2: Group("16"), 3: Group("16")}
    dp = {0: Group("9"), 1: Group("10"), 2: Group("9"), 3: Group("10")}
    orders = {
        rank: [("tp" if g is tp[rank] else "dp") for g in grad_norm._ordered([grad_norm.MeshGroup("tp", tp[rank]), grad_norm.MeshGroup("dp_shard", dp[rank])])]
        for rank in range(4)
    }
    assert all(order == ["dp", "tp"] for order in orders.values()), orders


def test_gradients_sharded_over_two_mesh_dimensions_count_once():
    """dp2 x tp2 (FSDP2 over a tensor-parallel split): shards over both dimensions, over dp only, and whole."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(2)
    wholes = [torch.randn(4, 6, dtype=torch.float64), torch.randn(8, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w) for w in wholes]))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with LocalTensorMode(4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
            params = [nn.Parameter(torch.zeros(w.shape, dtype=torch.float64)) for w in wholes]
            for param, whole, placements in zip(params, wholes, ([Shard(0), Shard(1)], [Shard(0), Replicate()], None)):
                param.grad = whole.clone() if placements is None else distribute_tensor(whole, mesh, placements)
            norm = total_grad_norm(params)
            values = {rank: float(t) for rank, t in norm._local_tensors.items()}
    finally:
        dist.destroy_process_group()
    assert values == pytest.approx({rank: float(expected) for rank in range(4)}, rel=1e-12)
