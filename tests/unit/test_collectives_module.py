"""One module issues every collective, and it hands each backend tensors on the device that backend serves.

NCCL refuses host tensors (``No backend type associated with device type cpu``); a process group registered for
CUDA only (``cuda:fake`` here, ``cuda:gloo`` or ``nccl`` on a GPU) refuses them the same way, so this machine,
with no GPU, checks the rule: real host tensors are refused by such a group directly, and go through
:mod:`lightning_parallel.collectives` on the group's device (fake CUDA tensors stand in for the device copies).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_parallel import collectives

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_parallel"
#: The only modules allowed to reach torch's collectives: the one that issues them, and the counter that wraps
#: torch's functional collectives to tally what DTensor sends (it issues none itself).
ALLOWED = {PACKAGE / "collectives.py", PACKAGE / "measure" / "collectives.py"}
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv",
    "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
    "monitored_barrier", "_broadcast_coalesced", "all_gather_single", "all_gather_tensor",
    "all_gather_tensor_autograd", "reduce_scatter_single",
}
TORCH_DISTRIBUTED = ("torch.distributed", "torch.distributed._functional_collectives", "torch.distributed.nn.functional")


def direct_collective_calls(source: str) -> Iterator[tuple[int, str]]:
    """(line, call) for each collective called on torch.distributed (under any alias) or imported from it."""
    tree = ast.parse(source)
    owners = set(TORCH_DISTRIBUTED)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            owners |= {a.asname or a.name for a in node.names if a.name in TORCH_DISTRIBUTED}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in TORCH_DISTRIBUTED:
                    owners.add(alias.asname or alias.name)
                elif node.module in TORCH_DISTRIBUTED and alias.name in COLLECTIVES:
                    yield node.lineno, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            if ast.unparse(node.func.value) in owners:
                yield node.lineno, ast.unparse(node.func)


def test_no_collective_is_called_outside_the_collectives_module():
    found = sorted(
        {
            f"{path.relative_to(PACKAGE.parent)}:{line}: {call}"
            for path in PACKAGE.rglob("*.py")
            if path not in ALLOWED
            for line, call in direct_collective_calls(path.read_text())
        }
    )
    assert not found, "call these through lightning_parallel.collectives (device-aware):\n" + "\n".join(found)


def test_the_scan_finds_collectives_however_torch_distributed_is_named():
    source = (
        "import torch\nimport torch.distributed as dist\nimport torch.distributed._functional_collectives as fc\n"
        "from torch.distributed import broadcast\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n    fc.all_gather_tensor(t, 0, None)\n"
        "    dist.get_rank()\n"
    )
    calls = {call for _, call in direct_collective_calls(source)}
    assert calls == {"dist.all_reduce", "torch.distributed.barrier", "fc.all_gather_tensor", "from torch.distributed import broadcast"}


@pytest.fixture
def cuda_only_group():
    """A 2-rank process group with a backend for CUDA only, as NCCL is (values are not real: shapes and devices are)."""
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_cuda_only_group_refuses_host_tensors_and_the_module_moves_them(cuda_only_group, monkeypatch):
    assert collectives.group_device(cuda_only_group).type == "cuda"
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(3))
    seen: list[torch.device] = []
    for name in ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            seen.extend(a.device for a in args if isinstance(a, torch.Tensor))
            seen.extend(t.device for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor))
            # The fake backend then checks the devices too (its broadcast asks for a real GPU's properties).
            return None if _name == "broadcast" else _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    # Fake tensors have devices but no copies between them on a build without CUDA: the copies are stood in for.
    copied_back: list[torch.Tensor] = []
    monkeypatch.setattr(collectives, "_copy_to", lambda t, device: torch.empty(t.shape, dtype=t.dtype, device=device))
    monkeypatch.setattr(collectives, "_copy_back", lambda original, copy: copied_back.append(original))
    with FakeTensorMode(allow_non_fake_inputs=False):
        host = torch.ones(4)  # a parameter of a module built on the host, as Trainer.fit(model) leaves it
        assert collectives.all_reduce(host) is host and host.device.type == "cpu"
        collectives.broadcast(host, cuda_only_group, group_src=0)
        gathered = collectives.all_gather(host, cuda_only_group)
        assert [g.device.type for g in gathered] == ["cpu", "cpu"]
        collectives.all_to_all_single(torch.empty(4), host)
        collectives.all_gather_into_tensor(torch.empty(8), host)
        collectives.broadcast_coalesced([torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(5)])
    assert seen and all(device.type == "cuda" for device in seen), seen
    # Written results reach the caller's tensors; inputs that are only read are not written back.
    assert len(copied_back) == 6 and copied_back[:2] == [host, host]  # 4 + one per dtype bucket


def test_a_group_that_serves_the_host_gets_the_tensors_as_they_are(monkeypatch):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert collectives.group_device().type == "cpu"
        tensor = torch.arange(3.0)
        calls = []
        monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(t))
        collectives.all_reduce(tensor)
        assert calls[0] is tensor  # no copy where none is needed
    finally:
        dist.destroy_process_group()


def test_broadcast_coalesced_sends_one_bucket_per_dtype_and_writes_every_tensor_back(monkeypatch):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        sent = []

        def fake_broadcast(flat, group=None, group_src=0):
            sent.append(flat.dtype)
            flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype))  # "rank 0's" values

        monkeypatch.setattr(dist, "broadcast", fake_broadcast)
        a, b, c = torch.zeros(2, 2), torch.zeros(3, dtype=torch.float64), torch.zeros(1)
        collectives.broadcast_coalesced([a, b, c])
        assert sorted(map(str, sent)) == ["torch.float32", "torch.float64"]
        assert a.flatten().tolist() == [0, 1, 2, 3] and c.tolist() == [4] and b.tolist() == [0, 1, 2]
        sent.clear()
        collectives.broadcast_coalesced([torch.zeros(4), torch.zeros(4)], bucket_bytes=16)
        assert len(sent) == 2  # a bucket never exceeds its bytes (unless one tensor alone does)
    finally:
        dist.destroy_process_group()
