"""Fused projections split by whole blocks and heads, with checkpoints in the module's own layout.

A fused projection computes several outputs with one matrix: ``q | k | v`` (GPT-2's ``c_attn``, Phi-3's
``qkv_proj``; with grouped-query attention the k and v blocks are smaller than q) or ``gate | up``
(``gate_up_proj``). A plain column split would hand rank 0 all of q and part of k. Here each block is split
into ``tp`` equal parts (whole heads) and rank ``r`` holds part ``r`` of every block, in block order: its
local output is ``q_r | k_r | v_r``, which the module's own slicing reads as its (fewer) heads.

The parameter is a ``Shard`` DTensor of the rows reordered *rank-major* (all of rank 0's blocks, then rank
1's, ...). That order exists only while the module trains: ``state_dict()`` hands out the tensor in the
module's own order (a ``Shard`` DTensor of it; one layer is gathered at a time), and ``load_state_dict``
takes that order back (whole tensors or DTensors). So checkpoints, full or sharded, are the unsplit
module's, load under any layout, and read Hugging Face weights as they are. Optimizer states are
converted by :func:`optimizer_state_to_original` / :func:`optimizer_state_to_rank_major`. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor, nn

#: Attribute set on a module with split fused parameters: ``{parameter name: FusedLayout}``. Kept on the
#: module, not the parameter: ``module.to()``/``.double()`` swap DTensor parameters' Python attributes away.
LAYOUT_ATTRIBUTE = "_lightning_parallel_fused_layouts"


@dataclass(frozen=True)
class FusedLayout:
    """Where a fused parameter's blocks lie and how they are split.

    Attributes:
        dim: The parameter's dimension holding the output features (0 for ``nn.Linear`` weights and all
            biases, 1 for transformers' ``Conv1D`` weights, stored transposed).
        blocks: Sizes of the fused blocks along ``dim``, in order (e.g. ``(q, k, v)``).
        tp_size: Tensor-parallel ranks; every block divides by it.
    """

    dim: int
    blocks: tuple[int, ...]
    tp_size: int

    @cached_property
    def _rank_major(self) -> Tensor:
        """``order[i]``: the original index of position ``i`` in the rank-major order."""
        starts = torch.tensor([0, *self.blocks[:-1]]).cumsum(0).tolist()
        parts = []
        for rank in range(self.tp_size):
            for start, size in zip(starts, self.blocks):
                part = size // self.tp_size
                parts.append(torch.arange(start + rank * part, start + (rank + 1) * part))
        return torch.cat(parts)

    @cached_property
    def _original(self) -> Tensor:
        return torch.argsort(self._rank_major)

    def to_rank_major(self, whole: Tensor) -> Tensor:
        """A whole tensor in the module's order, reordered so that rank ``r``'s blocks are its ``r``-th chunk."""
        return whole.index_select(self.dim, self._rank_major.to(whole.device))

    def to_original(self, whole: Tensor) -> Tensor:
        """The inverse of :meth:`to_rank_major`."""
        return whole.index_select(self.dim, self._original.to(whole.device))


def layouts_of(module: nn.Module) -> dict[str, FusedLayout]:
    """The fused layouts of ``module``'s own split parameters, by parameter name (empty for other modules)."""
    return getattr(module, LAYOUT_ATTRIBUTE, {})


def fused_layouts(module: nn.Module) -> dict[str, FusedLayout]:
    """Every split fused parameter under ``module``, by full name."""
    return {
        f"{prefix}.{name}" if prefix else name: layout
        for prefix, sub in module.named_modules()
        for name, layout in layouts_of(sub).items()
    }


def original_order(module: nn.Module, name: str, whole: Tensor) -> Tensor:
    """``whole`` (the gathered value of ``module``'s parameter ``name``, or of its gradient) in the module's own order."""
    layout = fused_layouts(module).get(name)
    return whole if layout is None else layout.to_original(whole)


def rank_major_rows(param: Tensor, layout: FusedLayout) -> Tensor:
    """Reorder a still-whole parameter's data rank-major, in place (before it is sharded)."""
    with torch.no_grad():
        param.data = layout.to_rank_major(param.data).contiguous()
    return param


def mark(module: nn.Module, layouts: Mapping[str, FusedLayout]) -> None:
    """After sharding: tag ``module``'s parameters with their layouts and convert its state dict in and out."""
    setattr(module, LAYOUT_ATTRIBUTE, dict(layouts))
    module._register_state_dict_hook(_state_in_original_order)
    module._register_load_state_dict_pre_hook(_load_from_original_order, with_module=True)


def _to_original_dtensor(value: Tensor, layout: FusedLayout) -> Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return layout.to_original(value)
    # One layer whole at a time; each rank keeps only its part of the module-order tensor.
    return _placed_like(layout.to_original(value.full_tensor()), value)


def _placed_like(whole: Tensor, like: Tensor) -> Tensor:
    """``whole`` (the same on every rank) as a DTensor placed like ``like``: each rank keeps its part, no
    communication. Any mesh: the tp mesh alone, or tp inside FSDP's (dp_shard, tp) with strided shards."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def _to_rank_major_dtensor(value: Tensor, like: Tensor, layout: FusedLayout) -> Tensor:
    """``value`` (module order, whole or a DTensor) rank-major, placed like ``like``."""
    from torch.distributed.tensor import DTensor

    whole = value.full_tensor() if isinstance(value, DTensor) else value
    ordered = layout.to_rank_major(whole.to(like.device))
    return _placed_like(ordered, like) if isinstance(like, DTensor) else ordered


def _state_in_original_order(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    for name, layout in layouts_of(module).items():
        if prefix + name in state:
            state[prefix + name] = _to_original_dtensor(state[prefix + name], layout)


def _load_from_original_order(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    for name, layout in layouts_of(module).items():
        key, param = prefix + name, getattr(module, name)
        if isinstance(state.get(key), Tensor) and tuple(state[key].shape) == tuple(param.shape):
            state[key] = _to_rank_major_dtensor(state[key], param, layout)


def optimizer_state_to_original(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``get_optimizer_state_dict``) with fused parameters' tensors in module order."""
    return _convert_optimizer_state(module, state, lambda value, param, layout: _to_original_dtensor(value, layout))


def optimizer_state_to_rank_major(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_to_original`, ready for ``set_optimizer_state_dict`` (whole
    tensors stay whole, DTensors stay DTensors)."""
    from torch.distributed.tensor import DTensor

    def convert(value: Tensor, param: Tensor, layout: FusedLayout) -> Tensor:
        if isinstance(value, DTensor):
            return _to_rank_major_dtensor(value, param, layout)
        return layout.to_rank_major(value)

    return _convert_optimizer_state(module, state, convert)


def _convert_optimizer_state(module: nn.Module, state: dict[str, Any], convert: Any) -> dict[str, Any]:
    fused = fused_layouts(module)
    if not fused:
        return state
    converted = dict(state.get("state", {}))
    for name, layout in fused.items():
        entry = converted.get(name)
        if not isinstance(entry, dict):
            continue
        param = module.get_parameter(name)
        converted[name] = {
            key: convert(value, param, layout)
            if isinstance(value, Tensor) and tuple(value.shape) == tuple(param.shape)
            else value
            for key, value in entry.items()
        }
    return {**state, "state": converted}
