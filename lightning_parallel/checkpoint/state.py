"""Checkpoint state of split and staged modules as whole tensors keyed by parameter names.

Built on ``torch.distributed.checkpoint.state_dict``: every rank takes part, the result holds ordinary
tensors keyed by the module's own parameter names, so a file written under tensor parallelism loads into
the plain module with ``load_state_dict`` (the ``full`` save format; ``sharded.py`` writes each rank's shards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.optim import Optimizer


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """Unsharded model state (a collective: call on every rank)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load an unsharded state into a (possibly sharded) module on every rank."""
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Unsharded optimizer state keyed by parameter names (a collective: call on every rank)."""
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def named_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state keyed by parameter names, on CPU, on every rank (not a collective for
    unsharded modules: a pipeline stage's part)."""
    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))
    return apply_to_collection(state, Tensor, lambda t: t.detach().cpu())


def load_full_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`full_optimizer_state` output into ``optimizer`` over a (possibly sharded) module."""
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def gather_pipeline_parts(part: dict[str, Any], group: dist.ProcessGroup, dst_group_rank: int = 0) -> dict[str, Any]:
    """Merge per-stage states (model or optimizer, keyed by parameter names) onto one rank of ``group``.

    Every rank of the group must call it; the destination gets the whole state, the others their own part.
    """
    parts = collectives.gather_object(part, group, dst_group_rank)
    if parts is None:
        return part
    return _merge_optimizer_parts(parts) if _is_optimizer_state(part) else {k: v for p in parts for k, v in p.items()}


def all_pipeline_parts(part: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """:func:`gather_pipeline_parts`, merged on every rank of ``group``."""
    parts = collectives.all_gather_object(part, group)
    return _merge_optimizer_parts(parts) if _is_optimizer_state(part) else {k: v for p in parts for k, v in p.items()}


def is_named_optimizer_state(state: dict[str, Any]) -> bool:
    """Whether an optimizer state is keyed by parameter names (from :func:`full_optimizer_state`)."""
    return _is_optimizer_state(state) and all(isinstance(k, str) for k in state["state"])


def _is_optimizer_state(state: dict[str, Any]) -> bool:
    return set(state) == {"state", "param_groups"}


def _merge_optimizer_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"state": {}, "param_groups": [dict(g, params=[]) for g in parts[0]["param_groups"]]}
    for part in parts:
        merged["state"].update(part["state"])
        for group, part_group in zip(merged["param_groups"], part["param_groups"]):
            group["params"].extend(name for name in part_group["params"] if name not in group["params"])
    return merged


def load_into_stages(module: nn.Module, state: dict[str, Any], whole_shapes: dict[str, tuple[int, ...]], strict: bool = True) -> None:
    """Load a whole-model state into a module cut into pipeline stages (this rank's tensors only).

    Args:
        module: The staged module (tensors of other stages are ``None``).
        state: A whole-model state dict (as any layout saves it).
        whole_shapes: Name -> shape of every tensor of the whole module, recorded before it was cut.
        strict: Refuse missing or unexpected names (shapes must always match).

    Raises:
        RuntimeError: Names or shapes differ; the message lists them. Nothing is loaded then.
    """
    message = describe_mismatch(whole_shapes, {k: tuple(v.shape) for k, v in state.items()}, strict)
    if message:
        raise RuntimeError(f"The checkpoint does not fit this model: {message}. {MISMATCH_HINT}")
    # In place, so tensor-parallel stages (DTensors) keep their placement: each rank copies its part.
    for name, target in module.state_dict().items():
        if name in state:
            copy_whole_into(target, state[name])


#: How to get past a model/checkpoint mismatch, appended to the error.
MISMATCH_HINT = (
    "Resume with the model that wrote it; to load only the weights that match, set "
    "strict_loading = False on the LightningModule (shapes must still agree)."
)


def describe_mismatch(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], strict: bool = True) -> str:
    """What differs between the tensors a model expects and those a checkpoint holds ("" when they fit).

    Missing and unexpected names count only when ``strict``; a different shape always does.
    """
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = [f"{k}: {tuple(found[k])} in the checkpoint vs {tuple(expected[k])}" for k in expected if k in found and tuple(found[k]) != tuple(expected[k])]
    parts = [("missing", missing), ("unexpected", unexpected)] if strict else []
    parts.append(("shape mismatch", mismatched))
    return "; ".join(f"{label} {listing(items)}" for label, items in parts if items)


def listing(items: list[str], shown: int = 8) -> str:
    """``(count) [first few] and more``: names in an error message, however many there are."""
    return f"({len(items)}) {items[:shown]}{' and more' if len(items) > shown else ''}"


def local_named_optimizer_state(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The part of a name-keyed optimizer state that concerns the parameters ``names`` (one stage's)."""
    return {
        "state": {k: v for k, v in state["state"].items() if k in names},
        "param_groups": [dict(g, params=[p for p in g["params"] if p in names]) for g in state["param_groups"]],
    }


@torch.no_grad()
def copy_part_into(target: Tensor, read: Callable[[tuple[slice, ...] | None], Tensor]) -> None:
    """Copy into ``target`` (a DTensor: this rank's part only) from ``read(index)``, the whole tensor's slice.

    ``index`` is this rank's block of the whole tensor, or ``None`` (all of it) when the target is whole or
    its placements are not plain shards (the whole value is then split here, without communication).
    """
    if isinstance(target, DTensor) and all(type(p) in (Shard, Replicate) for p in target.placements):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        target.to_local().copy_(read(tuple(slice(o, o + n) for o, n in zip(offset, shape))))
    else:
        copy_whole_into(target, read(None))


@torch.no_grad()
def copy_whole_into(target: Tensor, value: Tensor) -> None:
    """Copy a whole tensor into ``target``, which may be a DTensor (each rank keeps its part, no communication)."""
    if isinstance(target, DTensor):
        value = distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    target.copy_(value)
from lightning_parallel import collectives
