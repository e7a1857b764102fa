"""Gradient-norm clipping over parameters that are partly DTensor shards and partly whole tensors.

``torch.nn.utils.clip_grad_norm_`` refuses a mix of DTensor and plain gradients (as tensor parallelism
leaves them: split layers are DTensors, norms and embeddings stay plain). Here each sharded gradient
contributes its shard's share, summed over its mesh, and each whole gradient counts once — the norm of
the full, unsplit gradient — and the scaling rule is torch's.

Built for the training step's hot path: the work does not grow with the number of parameters in anything
but device kernels. Gradients are grouped by the process groups their share must be summed over (the mesh
dimensions a DTensor is sharded on, plus ``sum_over``/``divided``); each group's local terms come from
``torch._foreach_norm`` and are summed on the device; then one all-reduce per *process group* combines the
terms of every group set that names it (a vector, one element per set), so the number of collectives is
bounded by the mesh, not by the model. The clip coefficient stays a device tensor: no ``.item()``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel import collectives


class MeshGroup(NamedTuple):
    """A mesh dimension a gradient is sharded over: its name (the same on every rank of the mesh) and its group."""

    dimension: str
    group: dist.ProcessGroup


def total_grad_norm(
    parameters: Iterable[Tensor],
    norm_type: float = 2.0,
    sum_over: dist.ProcessGroup | None = None,
    divided: tuple[Iterable[Tensor], dist.ProcessGroup] | None = None,
) -> Tensor:
    """The ``norm_type`` norm of all gradients together, as one device would compute it unsplit.

    Args:
        parameters: This rank's parameters.
        norm_type: As in ``torch.nn.utils.clip_grad_norm_``.
        sum_over: A group whose ranks hold *different* parameters (pipeline stages): their shares are
            combined, so every rank gets the norm of the whole model.
        divided: ``(some of parameters, group)``: those are held by one rank of ``group`` each, the others holding
            other ones in their place (experts kept as an ``nn.ModuleList`` divided by expert parallelism): their
            shares are combined over ``group``, the other parameters' not (nor over ``sum_over``).

    Returns:
        A 0-dim tensor on the gradients' device, float64 if any gradient is float64, else float32 (torch's
        own clipping accumulates low-precision gradients in float32 too).
    """
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    apart = {id(p) for p in divided[0]} if divided is not None else set()
    # (divided apart?, names of the groups a DTensor share is summed over) -> those groups and this rank's tensors.
    # Insertion order follows the parameters, the same on every rank of a mesh group (they hold the same parameters).
    shares: dict[tuple[bool, tuple[str, ...]], tuple[tuple[MeshGroup, ...], list[Tensor]]] = {}
    for param in parameters:
        if param.grad is None:
            continue
        local, over = _share(param.grad)
        names = tuple(m.group.group_name for m in over)
        shares.setdefault((id(param) in apart, names), (over, []))[1].append(local)
    grads = [t for _, tensors in shares.values() for t in tensors]
    device = grads[0].device if grads else collectives.group_device() if dist.is_initialized() else torch.device("cpu")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in grads) else torch.float32
    sets = list(shares)
    terms = [_local_term(shares[key][1], norm_type, device, dtype) for key in sets]
    op = collectives.MAX if inf else collectives.SUM
    # Mesh groups first: one collective each, for every set that names it.
    for group in _ordered([m for over, _ in shares.values() for m in over]):
        members = [i for i, key in enumerate(sets) if group.group_name in key[1]]
        stacked = collectives.all_reduce(torch.stack([terms[i] for i in members]), op=op, group=group)
        for position, i in enumerate(members):
            terms[i] = stacked[position]
    zero = torch.zeros((), dtype=dtype, device=device)
    # Then the groups whose ranks hold different parameters: one number each (their sets need not match).
    # These are reduced even where this rank has no gradient: the other ranks wait for it.
    rest = _combine([t for key, t in zip(sets, terms) if not key[0]], inf, zero)
    if sum_over is not None:
        collectives.all_reduce(rest, op=op, group=sum_over)
    total = rest
    if divided is not None:
        share = collectives.all_reduce(_combine([t for key, t in zip(sets, terms) if key[0]], inf, zero), op=op, group=divided[1])
        total = torch.maximum(rest, share) if inf else rest + share
    return total if inf else total ** (1.0 / norm_type)


def parameter_norm_terms(grads: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """Each gradient's own whole-tensor norm term, as one device would compute it unsplit: ``|g|_p^p`` (for the
    inf norm ``max |g|``), a vector with one element per gradient, on the gradients' device.

    Where a gradient is a DTensor shard, its local term is summed (inf: maxed) over the mesh groups it is sharded
    over: the terms of every gradient sharded over a group travel in *one* all-reduce over that group (a vector),
    groups taken in the same order on every rank (:func:`_ordered`); whole gradients need no collective. Every rank
    of those groups must call this with gradients sharded alike (as every rank of a mesh holds the same parameters).
    The ``p``-th root is left to the caller, which may still have to add the terms of other ranks' parameters
    (pipeline stages); float64 if any gradient is float64, else float32.
    """
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    shares = [_share(g) for g in grads]
    device = shares[0][0].device if shares else collectives.group_device() if dist.is_initialized() else torch.device("cpu")
    dtype = torch.float64 if any(local.dtype == torch.float64 for local, _ in shares) else torch.float32
    terms = torch.zeros(len(shares), dtype=dtype, device=device)
    positions: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, (local, _) in enumerate(shares):
        if local.numel():  # an empty shard (FSDP2 pads small tensors) contributes nothing
            positions[(local.device, local.dtype)].append(i)
    for (_, grad_dtype), indices in positions.items():
        low = grad_dtype in (torch.float16, torch.bfloat16)
        # torch._foreach_norm: private (checked against torch 2.13), as in _local_term.
        norms = torch._foreach_norm([shares[i][0] for i in indices], norm_type, dtype=torch.float32 if low else None)
        stacked = torch.stack([n.to(device=device, dtype=dtype) for n in norms])
        terms[torch.tensor(indices, device=device)] = stacked if inf else stacked.pow(norm_type)
    op = collectives.MAX if inf else collectives.SUM
    for group in _ordered([m for _, over in shares for m in over]):
        members = torch.tensor(
            [i for i, (_, over) in enumerate(shares) if any(m.group.group_name == group.group_name for m in over)], device=device
        )
        terms[members] = collectives.all_reduce(terms[members], op=op, group=group)
    return terms


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    exclude_from_norm: Iterable[Tensor] = (),
    sum_over: dist.ProcessGroup | None = None,
    divided: tuple[Iterable[Tensor], dist.ProcessGroup] | None = None,
) -> Tensor:
    """Scale gradients in place so that their total norm is at most ``max_norm``; returns the norm before.

    ``exclude_from_norm`` are scaled but not counted (copies of tied weights another rank counts);
    ``sum_over`` and ``divided`` as in :func:`total_grad_norm`. Nothing here waits for the device: the
    coefficient is multiplied in as a tensor, as ``torch.nn.utils.clip_grads_with_norm_`` does.
    """
    parameters = [p for p in parameters if p.grad is not None]
    excluded = {id(p) for p in exclude_from_norm}
    norm = total_grad_norm([p for p in parameters if id(p) not in excluded], norm_type, sum_over, divided)
    # Same rule as torch.nn.utils.clip_grad_norm_.
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for (device, _), grads in _by_device_and_dtype([_local(p.grad) for p in parameters]).items():
            # torch._foreach_mul_ is private (checked against torch 2.13): what clip_grads_with_norm_ runs; that
            # public function hands DTensor gradients to DTensor dispatch, which refuses the plain coefficient.
            torch._foreach_mul_(grads, coefficient.to(device))
    return norm


def clip_optimizer_grad_norm(
    optimizer: torch.optim.Optimizer, clip_val: float, divided: tuple[Iterable[Tensor], dist.ProcessGroup] | None = None
) -> None:
    """Clip the gradients of ``optimizer``'s parameters (the signature of Lightning's ``clip_grad_by_norm``;
    ``divided`` as in :func:`total_grad_norm`)."""
    clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], clip_val, divided=divided)


def _share(grad: Tensor) -> tuple[Tensor, tuple[MeshGroup, ...]]:
    """This rank's part of ``grad`` and the mesh groups its norm term is summed over (none for a whole tensor)."""
    if not isinstance(grad, DTensor):
        return grad.detach(), ()
    if any(p.is_partial() for p in grad.placements):
        # Unreduced sums: reduce them first, or the shares would not add up to the true gradient.
        grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
    # Anything neither replicated nor partial is a shard (FSDP over TP uses strided shards).
    mesh = grad.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim {dim} of {mesh.ndim}" for dim in range(mesh.ndim))
    over = tuple(MeshGroup(names[dim], mesh.get_group(dim)) for dim, p in enumerate(grad.placements) if not p.is_replicate())
    return _local(grad).detach(), over


def _ordered(groups: Iterable[MeshGroup]) -> list[dist.ProcessGroup]:
    """The distinct groups, ordered by their mesh dimensions' names (then their own names) alike on every rank.

    A term summed over dp and tp must be summed in the same order on every rank: a rank that went tp-first would
    hand its dp peer a term not yet summed over tp, while that peer, dp-first, hands back one summed over dp only.
    Ordering by the group's own name is not enough: the two tp groups of a dp2 x tp2 mesh sort differently against
    their dp groups."""
    distinct: dict[str, MeshGroup] = {}
    for m in groups:  # one group under two names (two meshes): its first name in sorted order, on every rank alike
        seen = distinct.get(m.group.group_name)
        distinct[m.group.group_name] = m if seen is None or m.dimension < seen.dimension else seen
    return [m.group for m in sorted(distinct.values(), key=lambda m: (m.dimension, m.group.group_name))]


def _combine(terms: Sequence[Tensor], inf: bool, zero: Tensor) -> Tensor:
    if not terms:
        return zero.clone()
    stacked = torch.stack(terms)
    return stacked.max() if inf else stacked.sum()


def _local_term(tensors: Sequence[Tensor], norm_type: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The sum of ``|x|^p`` over ``tensors`` (the max of ``|x|`` for the inf norm), in ``dtype`` on ``device``."""
    norms: list[Tensor] = []
    for (_, grad_dtype), group in _by_device_and_dtype([t for t in tensors if t.numel()]).items():
        # torch._foreach_norm is private (checked against torch 2.13): torch.nn.utils.get_total_norm's kernel
        # (one launch per group on CUDA); asked for float32 results from 16-bit gradients, it accumulates in float32.
        low = grad_dtype in (torch.float16, torch.bfloat16)
        norms.extend(n.to(device=device, dtype=dtype) for n in torch._foreach_norm(group, norm_type, dtype=torch.float32 if low else None))
    if not norms:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack(norms)
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def _by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    grouped: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        grouped[(tensor.device, tensor.dtype)].append(tensor)
    return grouped


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
