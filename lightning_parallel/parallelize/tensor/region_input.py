"""One DTensor input for all the column-wise projections of a region (attention, MLP), however it is called.

Where several column-wise projections read one tensor (q/k/v, gate/up), handing them the *same* replicated
DTensor makes backward sum their input gradients as one partial sum, reduced once (Megatron's single
all-reduce, or reduce-scatter under sequence parallelism) instead of once per projection. The tensor is
caught where each projection receives it (``self.q_proj(hidden_states)``), not at the region's own
signature: Hugging Face layers call attention with keyword arguments only
(``self_attn(hidden_states=..., position_embeddings=..., attention_mask=...)``), and the region's other
inputs (rotary tables, masks) must stay ordinary tensors. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

#: Keyword names under which a region (attention, MLP) receives its hidden states.
HIDDEN_STATE_KEYWORDS = ("hidden_states", "x", "hidden", "input")


def map_hidden_states(
    args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Tensor], Tensor], name: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a call with ``fn`` applied to its hidden states: the first positional tensor,
    or the first of :data:`HIDDEN_STATE_KEYWORDS` given.

    Raises:
        TypeError: The call has neither (naming the module ``name``).
    """
    if args and isinstance(args[0], Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    for key in HIDDEN_STATE_KEYWORDS:
        if isinstance(kwargs.get(key), Tensor):
            return args, {**kwargs, key: fn(kwargs[key])}
    raise TypeError(
        f"sequence_parallel=True: {name} was called without its hidden states as the first positional argument "
        f"or as one of the keywords {', '.join(HIDDEN_STATE_KEYWORDS)}; set sequence_parallel=False for this model."
    )


class SharedRegionInput:
    """Converts each tensor entering the region's projections to a replicated DTensor once per region call.

    Args:
        mesh: The tensor-parallel mesh.
        arrives_as: How the input is laid out when it arrives: ``Replicate()`` (plain TP, the default), or
            ``Shard(sequence_dim)`` under sequence parallelism (then it is all-gathered here, once).
    """

    def __init__(self, mesh: DeviceMesh, arrives_as: Placement | None = None) -> None:
        self.mesh = mesh
        self.arrives_as = arrives_as if arrives_as is not None else Replicate()
        self._converted: list[tuple[Tensor, DTensor]] = []

    def attach(self, region: nn.Module, projections: list[nn.Module], name: str = "") -> None:
        """Hook ``region`` (clears the cache per call) and its ``projections`` (share their input).

        Under sequence parallelism the region's hidden-state input is gathered on entry instead, since
        the region may read its shape (``hidden_states.shape[:-1]`` to split heads): the first positional
        tensor, or the keyword argument ``hidden_states`` (``x``, ``hidden``, ``input``).
        """
        self._name = name or type(region).__name__
        if self.arrives_as.is_replicate():
            region.register_forward_pre_hook(self._clear)
        else:
            region.register_forward_pre_hook(self._gather_on_entry, with_kwargs=True)
        region.register_forward_hook(self._clear_after)
        for projection in projections:
            # First among the projection's hooks: its own style then finds a DTensor already.
            projection.register_forward_pre_hook(self._share, prepend=True)

    def _clear(self, *_: Any) -> None:
        self._converted = []

    def _gather_on_entry(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        self._converted = []
        return map_hidden_states(args, kwargs, self._replicated, self._name)

    def _replicated(self, tensor: Tensor) -> Tensor:
        if isinstance(tensor, DTensor):
            return tensor
        shared = DTensor.from_local(tensor, self.mesh, [self.arrives_as], run_check=False).redistribute(placements=[Replicate()])
        self._converted.append((tensor, shared))
        return shared

    def _clear_after(self, *_: Any) -> None:
        self._converted = []

    def _share(self, _: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], Tensor) or isinstance(args[0], DTensor):
            return None
        tensor = args[0]
        for seen, shared in self._converted:
            if seen is tensor:
                return (shared, *args[1:])
        shared = DTensor.from_local(tensor, self.mesh, [self.arrives_as], run_check=False)
        if not self.arrives_as.is_replicate():
            shared = shared.redistribute(placements=[Replicate()])
        self._converted.append((tensor, shared))
        return (shared, *args[1:])
