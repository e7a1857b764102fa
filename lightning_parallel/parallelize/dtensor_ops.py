"""DTensor sharding rules torch lacks for CPU attention, so traced tensor-parallel stages run on CPU too.

Pipeline stages split by tensor parallelism run their traced ATen graph on DTensors (see
:mod:`lightning_parallel.parallelize.staged_tensor`). On CUDA torch.export records
``_scaled_dot_product_flash_attention`` (DTensor has rules for it); on CPU it records
``_scaled_dot_product_flash_attention_for_cpu``, which has none. Attention is independent per head and
per sequence, so the rules are the ones torch gives the CUDA kernel: everything replicated, q/k/v split
over heads (tensor parallelism), or over the batch. Registered once, on import. No Lightning here.
"""

from __future__ import annotations

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
from torch.distributed.tensor.placement_types import Replicate, Shard

aten = torch.ops.aten

#: Shard dimensions attention is independent along: batch (0) and heads (1).
_INDEPENDENT_DIMS = (0, 1)


def _has_mask(op_schema: OpSchema) -> bool:
    return op_schema.kwargs_schema.get("attn_mask") is not None


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default, schema_info=RuntimeSchemaInfo(3))
def _cpu_flash_attention_strategy(op_schema: OpSchema) -> OpStrategy:
    # Placement lists are [output, logsumexp, query, key, value].
    strategies: list[PlacementList] = [[Replicate()] * 5]
    if not _has_mask(op_schema):  # a mask's broadcast dimensions are unknown here: replicate then
        strategies += [[Shard(dim)] * 5 for dim in _INDEPENDENT_DIMS]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, strategies, input_index=2)


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, schema_info=RuntimeSchemaInfo(6))
def _cpu_flash_attention_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    # Placement lists are [grad_q, grad_k, grad_v, grad_out, query, key, value, out, logsumexp].
    strategies: list[PlacementList] = [[Replicate()] * 9]
    if not _has_mask(op_schema):
        strategies += [[Shard(dim)] * 9 for dim in _INDEPENDENT_DIMS]
    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(validate=False), op_schema, strategies, input_index=3
    )
