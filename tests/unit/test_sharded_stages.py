"""FSDP2 over a pipeline rank's stages, driven by hand (parallelize/pipeline/sharded_stages.py).

One rank here (the multi-rank exactness is in tests/distributed/test_hybrid_parallel.py): which modules become
units, and that stage graphs holding the same names train the holder's parameters — gathered once, gradients
accumulated over several backwards and handed to the shards in one reduction.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_parallel.parallelize.pipeline.sharded_stages import ShardedStageParameters, shard_units
from lightning_parallel.parallelize.placement.deferred_init import allocate_local


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])  # a list inside a block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) + sum(e(x) for e in self.experts)


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: reachable from two children

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def test_blocks_then_children_then_the_holder_and_a_tied_weight_stays_one_parameter(one_rank_mesh):
    holder = TiedLM().double()
    units = shard_units(holder, one_rank_mesh)
    # Each block (not the experts inside it), the norm; the embedding and head share a weight: the holder keeps it.
    assert units == [holder.blocks[0], holder.blocks[1], holder.norm, holder]
    assert holder.head.weight is holder.embed.weight
    assert all(isinstance(p, DTensor) for p in holder.parameters())


def test_stage_graphs_train_the_holder_with_one_reduction_per_optimizer_step(one_rank_mesh):
    torch.manual_seed(0)
    holder = TiedLM().double()
    plain = copy.deepcopy(holder)
    stage = copy.deepcopy(holder)  # stands in for a traced stage graph: the same parameter names
    sharded = ShardedStageParameters(holder, one_rank_mesh)
    sharded.adopt([stage])
    batches = [torch.randint(0, 11, (3, 5)) for _ in range(2)]
    for idx in batches:  # two accumulated steps: gathered once, no reduction in between
        sharded.gather()
        assert sharded.gathered
        assert all(not isinstance(p, DTensor) for p in stage.parameters())
        stage(idx).square().mean().backward()
        plain(idx).square().mean().backward()
    sent = sharded.reduce()
    assert sent > 0 and not sharded.gathered
    whole = dict(plain.named_parameters())
    for name, param in holder.named_parameters():
        assert isinstance(param.grad, DTensor), name
        torch.testing.assert_close(param.grad.full_tensor(), whole[name].grad, rtol=0, atol=1e-12, msg=name)
    # A sharded parameter changed by the optimizer is what the next gather binds.
    with torch.no_grad():
        holder.norm.weight.add_(1.0)
    sharded.gather()
    torch.testing.assert_close(stage.norm.weight.detach(), whole["norm.weight"].detach() + 1.0)
    sharded.release()  # gradients are still on the shards, none on the gathered tensors: freed
    assert not sharded.gathered


def test_a_holder_built_on_the_meta_device_is_sharded_there_and_only_its_shards_get_memory(one_rank_mesh):
    with torch.device("meta"):
        holder = TiedLM().double()
    holder.register_buffer("table", torch.empty(4, device="meta"))
    stage = copy.deepcopy(holder)  # a stage traced from the meta skeleton: meta tensors under the same names
    sharded = ShardedStageParameters(holder, one_rank_mesh, allocate=lambda m: allocate_local(m, torch.device("cpu")))
    assert not any(t.is_meta for t in sharded.tensors().values())
    assert all(isinstance(p, DTensor) and not p.to_local().is_meta for p in holder.parameters())
    sharded.adopt([stage])  # the stage reads the holder's tensors from now on, buffers included
    assert stage.table is holder.table and not stage.table.is_meta
    sharded.gather()
    assert not any(p.is_meta for p in stage.parameters())



def test_under_autocast_gradients_of_every_micro_batch_add_up_in_float32(one_rank_mesh):
    """bf16-mixed: the stages compute in bf16 under autocast, but parameters are gathered in float32 (the dtype the
    stages were traced with) and the gradients of every micro-batch and accumulated step add up in float32, as one
    device's do on its float32 weights. One gradient of 1, then 64 of 2^-9: in bf16 each small one would round away
    (bf16's spacing at 1 is 2^-7), as it did when the parameters were gathered as bf16 copies."""
    holder = nn.Sequential(nn.Linear(4, 1, bias=False))
    stage = copy.deepcopy(holder)
    sharded = ShardedStageParameters(holder, one_rank_mesh)
    sharded.adopt([stage])
    for step in range(2):  # two accumulated steps, gathered once
        sharded.gather()
        assert stage[0].weight.dtype == torch.float32
        for _ in range(1 if step == 0 else 64):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = stage(torch.full((1, 4), 1.0 if step == 0 else 2.0**-9))
            assert out.dtype == torch.bfloat16
            out.float().sum().backward()
    sharded.reduce()
    grad = holder[0].weight.grad
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad.full_tensor(), torch.full((1, 4), 1.0 + 64 * 2.0**-9), rtol=0, atol=0)
