"""The dispatch-level device check, on a CUDA-only fake group with fake CUDA tensors (no GPU here): it catches the
host tensor that ``FakeTensorMode`` alone lets through, and passes what :mod:`lightning_parallel.collectives` places."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_parallel import collectives
from lightning_parallel.observe.collective_devices import CollectiveDevices


@pytest.fixture
def cuda_only_group():
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_fake_tensors_alone_let_a_host_tensor_through_and_the_check_does_not(cuda_only_group, monkeypatch):
    with FakeTensorMode(allow_non_fake_inputs=True):
        dist.all_reduce(torch.ones(3))  # the gap: accepted here, refused by NCCL
        with CollectiveDevices("cuda") as check:
            with pytest.raises(RuntimeError, match=r"c10d\.allreduce_\.default was handed a tensor on cpu.*lightning_parallel\.collectives"):
                dist.all_reduce(torch.ones(3))
            dist.all_reduce(torch.ones(3, device="cuda"))
            functional.all_reduce(torch.ones(3, device="cuda"), "sum", cuda_only_group)  # DTensor's kind
            with pytest.raises(RuntimeError, match=r"_c10d_functional\.all_gather_into_tensor\.default .* on cpu"):
                functional.all_gather_tensor(torch.ones(3), 0, cuda_only_group)
        # The library's module places a host tensor on the group's device first (copies stood in: no CUDA here).
        monkeypatch.setattr(collectives, "_copy_to", lambda t, device: torch.empty(t.shape, dtype=t.dtype, device=device))
        monkeypatch.setattr(collectives, "_copy_back", lambda original, copy: None)
        with CollectiveDevices("cuda") as placed:
            collectives.all_reduce(torch.ones(4))
            collectives.all_gather_into_tensor(torch.empty(8), torch.ones(4))
            collectives.reduce_scatter_tensor(torch.empty(2), torch.ones(4))
    assert check.checked >= 4 and placed.checked == 3


def test_device_type_is_checked():
    with pytest.raises(TypeError, match="device_type must be"):
        CollectiveDevices(torch.device("cuda"))  # type: ignore[arg-type]
