"""Multi-query attention with a fused q|k|v projection: the queries split by heads, the one key/value head gathered.

Multi-query attention (Falcon's ``multi_query``, GPT-BigCode/StarCoder, DBRX with ``kv_n_heads=1``) computes every
query head against one key head and one value head, often from one fused projection ``q | k | v``. Whole heads of
k and v cannot be divided among ranks, but every rank can compute its query heads against the whole k and v:

- the fused projection is split like any ``fused_qkv`` one (rank-major blocks, :mod:`~.fused`): rank ``r`` holds
  its query heads and the ``r``-th part of the key's and the value's features (``head_dim / tp`` each), so every
  parameter is held once (no copies, so checkpoints, optimizer state and gradient norms are the unsplit model's);
- right after the projection, each rank's parts of k and v are all-gathered into the whole head
  (:class:`KeyValueGather`); its backward reduce-scatters their gradients, which sums every rank's heads'
  contributions into each rank's part, as one device computes them;
- the query head counts (and the width the module splits its queries by, and the query heads per key/value head)
  shrink by the TP degree; the key/value head count stays 1.

No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_parallel.parallelize.tensor.projections import KEY_VALUE_HEADS

#: Attributes an attention may keep with the width of its query block, which it splits the fused output by
#: (GPT-BigCode's ``embed_dim``, DBRX's ``hidden_size``): divided on the module itself where equal to that width.
QUERY_WIDTH_ATTRIBUTES = ("embed_dim", "hidden_size", "split_size")
#: Attributes holding the query heads per key/value head (``repeat_kv``'s factor): with one key/value head, the
#: query head count, divided with it.
GROUP_ATTRIBUTES = ("num_key_value_groups", "num_kv_groups")


def is_multi_query(heads: tuple[int, int]) -> bool:
    """``(query heads, key/value heads)`` of a fused q|k|v projection describe multi-query attention."""
    query, key_value = heads
    return key_value == 1 and query > 1


def multi_query_attributes(attention: nn.Module, attributes: tuple[str, ...], query_width: int, query_heads: int) -> tuple[str, ...]:
    """The attributes of ``attention`` to divide by the TP degree when its queries split and its k/v head does not.

    Key/value head counts (``num_kv_heads``, ``config.num_key_value_heads``, ...) are dropped from ``attributes``;
    query-block widths and query-per-key/value group sizes kept on the module itself are added.
    """
    kept = tuple(a for a in attributes if a.removeprefix("config.") not in KEY_VALUE_HEADS)
    extra = [a for a in QUERY_WIDTH_ATTRIBUTES if _count(attention, a) == query_width]
    extra += [a for a in GROUP_ATTRIBUTES if _count(attention, a) == query_heads]
    return tuple(dict.fromkeys(kept + tuple(extra)))


def _count(module: nn.Module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class KeyValueGather:
    """Forward hook of a split multi-query projection: its local output ``q_r | k_r | v_r`` becomes ``q_r | k | v``."""

    def __init__(self, blocks: tuple[int, int, int], tp_mesh: Any) -> None:
        tp_size = tp_mesh.size()
        self.local = tuple(size // tp_size for size in blocks)
        self.mesh = tp_mesh

    def __call__(self, module: nn.Module, inputs: tuple, output: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        if not isinstance(output, Tensor) or isinstance(output, DTensor) or output.shape[-1] != sum(self.local):
            raise RuntimeError(
                f"{type(module).__name__}: the split multi-query projection returned "
                f"{type(output).__name__} of shape {tuple(getattr(output, 'shape', ()))}, expected a local tensor of "
                f"{sum(self.local)} features (this rank's q | k | v parts). Leave its attention replicated in the plan."
            )
        query, key, value = output.split(self.local, dim=-1)
        last = output.dim() - 1

        def gathered(part: Tensor) -> Tensor:
            # Backward: each rank's gradient of the whole k (v) is a partial sum over its query heads; Partial ->
            # Shard reduce-scatters them, leaving each rank the summed gradient of its own features.
            return (
                DTensor.from_local(part, self.mesh, [Shard(last)], run_check=False)
                .redistribute(self.mesh, [Replicate()])
                .to_local(grad_placements=[Partial()])
            )

        return torch.cat([query, gathered(key), gathered(value)], dim=-1)


def gather_key_values(modules: Mapping[str, nn.Module], fused: Mapping[str, tuple[int, ...]], multi_query: Any, tp_mesh: Any) -> None:
    """Hook :class:`KeyValueGather` onto every split multi-query projection (after ``parallelize_module``)."""
    for fqn in multi_query:
        q, k, v = fused[fqn]
        modules[fqn].register_forward_hook(KeyValueGather((q, k, v), tp_mesh))
