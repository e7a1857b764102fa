"""Per-head inputs of a split attention module (ALiBi slopes, position biases) cut to the rank's heads.

ALiBi gives every head its own slope. BLOOM and Falcon build the biases once, in the model, for all ``H``
heads (``alibi``, shaped ``[batch·H, 1, keys]``), and hand them to every attention module; MPT's
``position_bias`` is ``[H, 1, keys]``. After a tensor-parallel split, rank ``r`` holds heads
``r·H/tp ... (r+1)·H/tp - 1`` (every style here gives each rank a contiguous range of whole heads), so it
must add *those* heads' biases: a forward pre-hook narrows the argument to them. Other per-head tensors an
attention module may read are not known here; one of these names whose layout is not recognised stops
with an error rather than mixing heads. No Lightning here.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_parallel.parallelize.tensor.projections import QUERY_HEADS, head_count
from lightning_parallel.parallelize.tensor.region_input import HIDDEN_STATE_KEYWORDS
from lightning_parallel.parallelize.tensor.plan import ResolvedPlan

#: Arguments of attention modules that hold one bias per head.
PER_HEAD_ARGUMENTS = ("alibi", "position_bias")


def slice_per_head_inputs(modules: Mapping[str, nn.Module], resolved: ResolvedPlan, tp_mesh: Any) -> None:
    """Hook every split attention module taking a :data:`PER_HEAD_ARGUMENTS` argument (before its head
    counts are divided: the hook needs the whole count)."""
    attentions = set(resolved.head_attributes) | {fqn.rpartition(".")[0] for fqn in resolved.heads}
    for fqn in sorted(attentions):
        attention = modules.get(fqn)
        if attention is None:
            continue
        try:
            parameters = list(inspect.signature(attention.forward).parameters)
        except (TypeError, ValueError):
            continue
        names = [name for name in PER_HEAD_ARGUMENTS if name in parameters]
        if not names:
            continue
        heads = head_count(attention, QUERY_HEADS)
        if heads is None:
            raise ValueError(
                f"{fqn}: takes per-head biases ({', '.join(names)}) but keeps no head count ({', '.join(QUERY_HEADS)}), "
                f"so its rank's heads cannot be told apart. Leave {fqn} replicated in the plan."
            )
        hook = _PerHeadSlice(fqn, names, parameters, heads[0], tp_mesh.size(), tp_mesh.get_local_rank())
        attention.register_forward_pre_hook(hook, with_kwargs=True)


class _PerHeadSlice:
    def __init__(self, fqn: str, names: list[str], parameters: list[str], heads: int, tp_size: int, rank: int) -> None:
        self.fqn, self.names, self.parameters = fqn, names, parameters
        self.heads, self.local = heads, heads // tp_size
        self.start = rank * self.local

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        args, kwargs = list(args), dict(kwargs)
        batch = self._batch(args, kwargs)
        for name in self.names:
            position = self.parameters.index(name)
            if name in kwargs and isinstance(kwargs[name], Tensor):
                kwargs[name] = self._narrow(name, kwargs[name], batch)
            elif position < len(args) and isinstance(args[position], Tensor):
                args[position] = self._narrow(name, args[position], batch)
        return tuple(args), kwargs

    def _batch(self, args: list[Any], kwargs: dict[str, Any]) -> int | None:
        hidden = args[0] if args and isinstance(args[0], Tensor) else next(
            (kwargs[k] for k in HIDDEN_STATE_KEYWORDS if isinstance(kwargs.get(k), Tensor)), None)
        return int(hidden.shape[0]) if hidden is not None and hidden.dim() >= 2 else None

    def _narrow(self, name: str, bias: Tensor, batch: int | None) -> Tensor:
        if bias.dim() == 4 and bias.shape[1] == self.heads:  # [batch, H, queries, keys]
            return bias.narrow(1, self.start, self.local)
        if bias.dim() == 3 and batch is not None and bias.shape[0] == batch * self.heads:  # [batch·H, q, keys]
            unfolded = bias.reshape(batch, self.heads, *bias.shape[1:])
            return unfolded.narrow(1, self.start, self.local).reshape(batch * self.local, *bias.shape[1:])
        if bias.dim() == 3 and bias.shape[0] == self.heads:  # [H, q, keys]
            return bias.narrow(0, self.start, self.local)
        raise RuntimeError(
            f"{self.fqn}: {name} of shape {tuple(bias.shape)} has no dimension of its {self.heads} heads "
            f"([batch, heads, q, k], [batch·heads, q, k] or [heads, q, k]), so this rank's heads cannot be cut from it. "
            f"Leave {self.fqn} replicated in the plan."
        )
