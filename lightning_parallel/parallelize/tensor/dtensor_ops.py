"""DTensor sharding rules torch lacks for CPU attention, so traced tensor-parallel stages run on CPU too.

Pipeline stages split by tensor parallelism run their traced ATen graph on DTensors (see
:mod:`lightning_parallel.parallelize.pipeline.stage_tensor`). The graph keeps ``aten.scaled_dot_product_attention``,
which DTensor decomposes at run time into the kernel the device picks. On CUDA those kernels have rules in
torch; on CPU the kernel is ``_scaled_dot_product_flash_attention_for_cpu``, which has none. Attention is
independent per head and per sequence, so the rules are the ones torch gives the CUDA kernels: everything
replicated, q/k/v split over heads (tensor parallelism), or over the batch.

The CPU kernel takes the attention mask (transformers' SDPA path always passes one) as the keyword argument
``attn_mask``, unexpanded: ``[B, 1, L, S]``, ``[L, S]`` or any shape that broadcasts to ``[B, H, L, S]``. A
rule must place it too (DTensor counts keyword tensors among the inputs). DTensor never redistributes a
keyword argument, though: the kernel gets the mask's local tensor as it is. So a split is offered only where
the mask already has the placement it needs: replicated where it broadcasts along the split dimension (size 1,
or absent: each rank's part then broadcasts to its own heads), split the same way otherwise. When no split
fits (a replicated per-head bias), attention runs replicated: q, k and v are gathered, the result is exact.
Registered once, on import. No Lightning here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpStrategy,
    PlacementList,
    RuntimeSchemaInfo,
)
from torch.distributed.tensor._ops.utils import (
    expand_to_full_mesh_op_strategy,
    register_op_strategy,
)
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

aten = torch.ops.aten

#: Shard dimensions attention is independent along: batch (0) and heads (1).
_INDEPENDENT_DIMS = (0, 1)
#: What DTensor's sharding cache keys on besides the positional tensors: dropout and causality, and the
#: mask (keyword tensors are not in the key otherwise, so a mask of another shape or placement would reuse
#: the decision made for the first one).
_SCHEMA_INFO_FORWARD = RuntimeSchemaInfo(3, static_kwargkey=["attn_mask"])
_SCHEMA_INFO_BACKWARD = RuntimeSchemaInfo(6, static_kwargkey=["attn_mask"])


def _mask_placements(op_schema: OpSchema, query_ndim: int) -> dict[int, Placement] | None:
    """Where the mask goes when q/k/v are split along each independent dim; ``None`` without a mask.

    The mask broadcasts against the attention scores ``[..., H, L, S]`` from the right: the query's
    dimension ``dim`` is the mask's ``dim - (query_ndim - mask_ndim)``.
    """
    mask = op_schema.kwargs_schema.get("attn_mask")
    if not isinstance(mask, OpStrategy):
        return None
    shape = mask.shape
    placements: dict[int, Placement] = {}
    for dim in _INDEPENDENT_DIMS:
        mask_dim = dim - (query_ndim - len(shape))
        placements[dim] = Shard(mask_dim) if mask_dim >= 0 and shape[mask_dim] != 1 else Replicate()
    return placements


def _strategies(op_schema: OpSchema, outputs: int, tensors: int, query_index: int) -> list[PlacementList]:
    """All replicated, or all split along one independent dim; the mask (last input) placed to match."""
    query = op_schema.args_schema[query_index]
    if not isinstance(query, OpStrategy):
        raise TypeError(f"{op_schema.op}: the query must be a DTensor, got {type(query).__name__}.")
    mask = _mask_placements(op_schema, len(query.shape))
    extra = [] if mask is None else [Replicate()]
    strategies: list[PlacementList] = [[Replicate()] * (outputs + tensors) + extra]
    for dim in _INDEPENDENT_DIMS:
        extra = [] if mask is None else [mask[dim]]
        strategies.append([Shard(dim)] * (outputs + tensors) + extra)
    return strategies


def _expand(op_schema: OpSchema, strategies: list[PlacementList], input_index: int, validate: bool = True) -> OpStrategy:
    mask = op_schema.kwargs_schema.get("attn_mask")
    current = mask.strategies[0].output_spec.placements if isinstance(mask, OpStrategy) else None

    def mask_as_it_is(input_specs: list[Any], _: Any) -> bool:
        # The mask is the last input; it reaches the kernel unredistributed (see the module doc).
        return current is None or tuple(input_specs[-1].placements) == tuple(current)

    result = expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(validate=validate),
        op_schema,
        strategies,
        input_index=input_index,
        is_valid_strategy_cb=mask_as_it_is,
    )
    if not result.strategies:
        raise RuntimeError(
            f"{op_schema.op}: the attention mask (shape {list(mask.shape)}) is placed {list(current)} on the "
            f"tensor-parallel mesh, which no split of the attention over batch or heads matches, and DTensor does "
            f"not redistribute a keyword argument. Build the mask from replicated values (positions, lengths)."
        )
    return result


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default, schema_info=_SCHEMA_INFO_FORWARD)
def _cpu_flash_attention_strategy(op_schema: OpSchema) -> OpStrategy:
    # Placement lists are [output, logsumexp, query, key, value, (attn_mask)].
    return _expand(op_schema, _strategies(op_schema, outputs=2, tensors=3, query_index=0), input_index=2)


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, schema_info=_SCHEMA_INFO_BACKWARD)
def _cpu_flash_attention_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    # Placement lists are [grad_q, grad_k, grad_v, grad_out, query, key, value, out, logsumexp, (attn_mask)].
    # The forward has checked the mesh already.
    return _expand(op_schema, _strategies(op_schema, outputs=3, tensors=6, query_index=1), input_index=3, validate=False)
