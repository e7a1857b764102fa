"""Worker for the tensor-parallel transform test: one rank of a TP group, plain torch (no Lightning).

Every rank builds the same float64 GPT, keeps an unsharded copy as the single-device reference, shards
the other with the inferred plan, and trains both for a few AdamW steps on the same batches.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.parallelize.tensor.apply import (
    apply_tensor_parallel,
    check_plan,
    infer_plan,
    resolve_plan,
)
from recipes.models.gpt import GPT


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run(rank: int, world_size: int, store: str, out: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        results = {tied: train(mesh, tied, steps) for tied in (True, False)}
        results["lookup_gaps"] = lookup_gaps(mesh)
        if rank == 0:
            torch.save(results, Path(out))
        # Leave together: a rank that exits while its peer's gloo threads still run can abort ("terminate called
        # without an active exception", seen in CI), as tests/jobs_worker.py explains.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(mesh, tied: bool, steps: int) -> dict:
    """The GPT (its embedding ``tied`` to the head or not) split over the inferred plan against its unsplit copy."""
    torch.manual_seed(0)
    reference = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.0, tie_weights=tied).double()
    sharded = copy.deepcopy(reference)
    resolved = resolve_plan(sharded, infer_plan(sharded))
    check_plan(sharded, resolved, mesh.size())
    apply_tensor_parallel(sharded, mesh, resolved)

    local_bytes = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in sharded.blocks[0].mlp.parameters())
    full_bytes = sum(p.numel() for p in reference.blocks[0].mlp.parameters())
    # The optimizer sees DTensor (split) and plain (replicated) parameters side by side.
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    generator = torch.Generator().manual_seed(1)
    losses, max_grad_gap, max_param_gap, lookup_grads = [], 0.0, 0.0, set()
    for _ in range(steps):
        idx = torch.randint(32, (4, 9), generator=generator)
        step_losses = []
        for model in (reference, sharded):
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1))
            loss.backward()
            step_losses.append(float(loss))
        grad = sharded.tok_emb.weight.grad
        lookup_grads.add((str(grad.placements), tuple(grad.to_local().shape)))
        for p_ref, p_tp in zip(reference.parameters(), sharded.parameters(), strict=True):
            max_grad_gap = max(max_grad_gap, float((full(p_tp.grad) - p_ref.grad).abs().max()))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for p_ref, p_tp in zip(reference.parameters(), sharded.parameters()):
            max_param_gap = max(max_param_gap, float((full(p_tp) - p_ref).abs().max()))
        losses.append(step_losses)
    return {"losses": losses, "grad_gap": max_grad_gap, "param_gap": max_param_gap, "local_mlp": local_bytes,
            "full_mlp": full_bytes, "n_head": sharded.blocks[0].attn.n_head, "lookup_grads": lookup_grads}


def lookup_gaps(mesh) -> dict[int, float]:
    """The split lookup's gradient against the whole table's, with the padding row on either rank (tokens repeated)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_parallel.parallelize.tensor.vocabulary import split_lookup

    gaps = {}
    for padding_idx in (3, 29):
        table = torch.randn(32, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
        ids = torch.tensor([[3, 3, 29, 0, 31], [16, 15, 3, 29, 16]])
        weights = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        (F.embedding(ids, table, padding_idx) * weights).sum().backward()
        split = distribute_tensor(table.detach(), mesh, [Shard(0)]).requires_grad_()
        looked_up = split_lookup(distribute_tensor(ids, mesh, [Replicate()]), split, padding_idx)
        (looked_up.redistribute(mesh, [Replicate()]).to_local() * weights).sum().backward()
        gaps[padding_idx] = float((split.grad.full_tensor() - table.grad).abs().max())
    return gaps
