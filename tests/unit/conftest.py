"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def simulated_ranks():
    """Two tensor-parallel ranks in this process: a fake process group, and a factory of ``LocalTensorMode(2)``
    contexts under which DTensor code runs both ranks' local tensors with real values."""
    # Private torch modules, checked against torch 2.13: no public API simulates ranks in one process.
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield lambda: LocalTensorMode(2)
    finally:
        dist.destroy_process_group()
